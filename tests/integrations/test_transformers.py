"""The Hugging Face integration (flashattn_ext.integrations.transformers) with tiny random models: logits on real
tokens of padded batches match the model's own eager path, a packed batch matches the padded one, greedy generation
gives the same tokens. Skipped without transformers."""
import inspect
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashattn_ext  # noqa: E402
import flashattn_ext.integrations.transformers as fa_hf  # noqa: E402
from reference import assert_error_within, attention_ref  # noqa: E402

fa_hf.register()

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def configs():
    """{name: config} of the families this transformers has: Llama, Mistral (sliding window), Qwen2, Gemma 2 (softcap
    and window), gpt-oss (sinks)."""
    made = {}
    candidates = {
        "llama": ("LlamaConfig", {}),
        "mistral": ("MistralConfig", dict(sliding_window=8)),
        "qwen2": ("Qwen2Config", {}),
        # Weights large enough for scores that the cap bends (at 0.02 it moved the logits by 3e-6).
        # query_pre_attn_scalar 4: a scaling that is not the op's default (1 / sqrt(head_dim)).
        "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, attn_logit_softcapping=5.0,
                                        query_pre_attn_scalar=4, initializer_range=0.1)),
        "gptoss": ("GptOssConfig", dict(head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=8)),
    }
    for name, (cls_name, extra) in candidates.items():
        cls = getattr(transformers, cls_name, None)
        if cls is not None:
            made[name] = cls(**{**TINY, **extra})
    return made


CONFIGS = configs()
# The settings of a family that our path must carry: dropping one changes the eager logits (test_settings_bind).
SETTINGS = [(name, setting) for name, setting in [("mistral", "sliding_window"), ("gemma2", "sliding_window"),
                                                    ("gemma2", "attn_logit_softcapping"),
                                                    ("gemma2", "query_pre_attn_scalar"), ("gptoss", "sliding_window")]
            if name in CONFIGS]


def model_pair(name, device="cpu", dtype=torch.float32):
    """The same weights with the eager path and with ours."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name], attn_implementation="eager")
    return model.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("name,setting", SETTINGS, ids=[f"{n}-{s}" for n, s in SETTINGS])
def test_settings_bind(name, setting):
    # The logit tests below can fail only if the settings matter for these tiny models: without the setting the eager
    # logits move by far more than those tests' tolerance.
    ids, mask = padded_batch()
    logits = []
    # a window longer than the batch: none; the scaling of the head dim (16): the default
    off = {"sliding_window": 4096, "attn_logit_softcapping": None, "query_pre_attn_scalar": 16}[setting]
    for config in (CONFIGS[name], type(CONFIGS[name])(**{**CONFIGS[name].to_dict(), setting: off})):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(model(ids, attention_mask=mask).logits[mask.bool()])
    assert (logits[0] - logits[1]).abs().max() > 100 * (2e-5 + 1e-4 * logits[0].abs().max())


def padded_batch(device="cpu"):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (3, 21), device=device)
    mask = torch.ones(3, 21, dtype=torch.long, device=device)
    mask[1, :6] = 0  # left padding
    mask[2, :15] = 0
    return ids, mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_logits_match_eager(name):
    model = model_pair(name)
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(fa_hf.NAME)
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_batch_matches_padded(name):
    model = model_pair(name)
    model.set_attn_implementation(fa_hf.NAME)
    torch.manual_seed(2)
    seqs = [torch.randint(0, 128, (n,)) for n in (5, 17, 1, 9)]
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None])
        alone = [model(s[None]).logits[0] for s in seqs]
    torch.testing.assert_close(packed.logits[0], torch.cat(alone), atol=2e-5, rtol=1e-4)


def test_packed_batch_from_flattening_kwargs(monkeypatch):
    # DataCollatorWithFlattening's cu_seq_lens_q / cu_seq_lens_k (and max lengths) reach the attention as kwargs,
    # and the packed call takes its boundaries from them.
    seen = []
    packed_call = fa_hf._packed_call
    monkeypatch.setattr(fa_hf, "_packed_call", lambda *a, **kw: seen.append(a[3].tolist()) or packed_call(*a, **kw))
    model = model_pair("llama")
    model.set_attn_implementation(fa_hf.NAME)
    torch.manual_seed(3)
    seqs = [torch.randint(0, 128, (n,)) for n in (6, 11, 3)]
    cu = torch.tensor([0, 6, 17, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=11, max_length_k=11)
        alone = [model(s[None]).logits[0] for s in seqs]
    torch.testing.assert_close(packed.logits[0], torch.cat(alone), atol=2e-5, rtol=1e-4)
    assert seen and all(bounds == cu.tolist() for bounds in seen)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_eager(name):
    model = model_pair(name)
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        model.set_attn_implementation(fa_hf.NAME)
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, ref)


def test_left_padded_generation_reads_the_cache_in_place(monkeypatch):
    # Batched generation pads the prompts on the left: each decoding step attends over the cache in place from each
    # row's first real key (cache_leftpad); only the prompt's pass gathers the real rows.
    leftpads, gathered = [], []
    kvcache, unpadding = fa_hf.flash_attn_with_kvcache, fa_hf._unpadding
    monkeypatch.setattr(fa_hf, "flash_attn_with_kvcache",
                        lambda *a, **kw: leftpads.append(kw.get("cache_leftpad")) or kvcache(*a, **kw))
    monkeypatch.setattr(fa_hf, "_unpadding", lambda *a: gathered.append(a[1:3]) or unpadding(*a))
    model = model_pair("llama")
    model.set_attn_implementation(fa_hf.NAME)
    ids, mask = padded_batch()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    layers = CONFIGS["llama"].num_hidden_layers
    assert len(leftpads) == 3 * layers and all(pad.tolist() == [0, 6, 15] for pad in leftpads)
    assert gathered == [(21, 21)]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", [name for name in ("llama", "mistral", "gemma2") if name in CONFIGS])
def test_static_cache_generation_matches_eager(name, padded):
    # A static cache's keys run past the valid ones (slots not written yet): without padding only the positions tell
    # how many are valid, with padding the mask is narrower than the keys.
    model = model_pair(name)
    ids, mask = padded_batch()
    if not padded:
        ids, mask = ids[:1], mask[:1]
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        model.set_attn_implementation(fa_hf.NAME)
        got = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=2e-5, rtol=1e-4)


def test_packed_positions_need_not_start_at_zero():
    # A row packs sequences wherever a position is not the one before plus 1 (as transformers' masks read it): the
    # first sequence may continue an earlier one (positions 5 .. 10).
    model = model_pair("llama")
    ids = torch.randint(0, 128, (1, 13))
    positions = torch.cat([torch.arange(5, 11), torch.arange(7)])[None]
    with torch.no_grad():
        ref = model(ids, position_ids=positions, use_cache=False).logits
        model.set_attn_implementation(fa_hf.NAME)
        got = model(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_output_in_the_inputs_dtype(monkeypatch):
    # Where the inputs are cast for the kernels (CUDA takes fp16 / bf16), the output comes back in their dtype for the
    # model's next layer (here the cast is forced on the CPU).
    monkeypatch.setattr(fa_hf, "_target_dtype", lambda query: torch.bfloat16)
    model = model_pair("llama")
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(fa_hf.NAME)
        got = model(ids, attention_mask=mask).logits
    assert got.dtype == torch.float32
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max() < 0.1


@pytest.mark.parametrize("name", [name for name in ("llama", "gemma2") if name in CONFIGS])
def test_a_padding_mask_is_read_once_per_forward(name, monkeypatch):
    # The layers of one forward share a mask (Gemma 2: one for its full and one for its sliding-window layers): its
    # values go to the host once per mask and forward, not once per layer.
    reads = []
    unpadding = fa_hf._unpadding
    monkeypatch.setattr(fa_hf, "_unpadding", lambda *a: reads.append(a[0]) or unpadding(*a))
    settings = {key: value for key, value in CONFIGS[name].to_dict().items() if key != "layer_types"}
    config = type(CONFIGS[name])(**{**settings, "num_hidden_layers": 6})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=fa_hf.NAME).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        model(ids, attention_mask=mask)
        first = len(reads)
        model(ids, attention_mask=mask)
    assert 1 <= first <= 2 and len(reads) == 2 * first, reads


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_bidirectional_sliding_window_is_transformers_mask(padded):
    # An encoder's sliding window (is_causal False) keeps the keys within it on both sides, as transformers' own
    # bidirectional overlay does (|q - kv| <= W); the causal language models above never take this branch. Over a
    # padded batch the real rows see the real keys within the window (both unpadded, positions kept relative), and
    # fewer queries than keys raise (no self-attention to follow).
    overlay = getattr(transformers.masking_utils, "sliding_window_bidirectional_overlay", None)
    if overlay is None:
        pytest.skip("this transformers has no bidirectional sliding window")
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 20, 16) for _ in range(3))
    mask = torch.ones(3, 20, dtype=torch.long)
    if padded:
        mask[1, 14:] = 0  # right padding
        mask[2, :5] = 0  # left padding
    got, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, mask if padded else None, sliding_window=3,
                                     is_causal=False)
    allowed = overlay(3)
    band = torch.tensor([[bool(allowed(0, 0, i, j)) for j in range(20)] for i in range(20)])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band & mask.bool()[:, None, None, :])
    real = mask.bool()
    torch.testing.assert_close(got[real], want.transpose(1, 2)[real], atol=1e-5, rtol=1e-4)
    if padded:
        with pytest.raises(ValueError, match="bidirectional sliding window"):
            fa_hf.attention_forward(torch.nn.Module(), q[:, :, :5], k, v, mask, sliding_window=3, is_causal=False)


def test_an_edited_mask_is_read_again():
    # The host reading of a mask is kept for the next layers only while the mask is unchanged: edited in place, it is
    # read again.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    first, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, mask, is_causal=True)
    mask[1, :6] = 0
    again, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, mask, is_causal=True)
    fresh, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, mask.clone(), is_causal=True)
    assert not torch.equal(first, again) and torch.equal(again, fresh)


def test_packed_keys_longer_than_queries():
    # cu_seq_lens_k may differ from cu_seq_lens_q (each sequence's queries its last rows): every sequence attends
    # bottom-right over its own keys.
    torch.manual_seed(0)
    bounds_q, bounds_k = [0, 3, 5], [0, 7, 11]
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 16)
    got, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True,
                                     cu_seq_lens_q=torch.tensor(bounds_q, dtype=torch.int32),
                                     cu_seq_lens_k=torch.tensor(bounds_k, dtype=torch.int32))
    for b in range(2):
        rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        want = flashattn_ext.flash_attn(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=True)
        torch.testing.assert_close(got[:, rows], want.transpose(1, 2))


@pytest.mark.parametrize("len_q", [5, 9, 13], ids=["fewer-queries", "as-many", "more-queries"])
def test_cross_attention_keeps_every_query(len_q):
    # Without a causal mask the padding mask is the keys' alone (an encoder's, in a decoder's cross-attention): every
    # query row attends over its entry's real keys, whatever the query and key lengths.
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, len_q, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding, as a padded encoder batch has it
    mask[2, :4] = 0  # left padding
    got, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, mask, is_causal=False)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :],
                                                            enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-4)


def test_encoder_decoder_logits_match_eager():
    # BART: the decoder's cross-attention over a right-padded encoder batch.
    if not hasattr(transformers, "BartConfig"):
        pytest.skip("this transformers has no BART")
    config = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    decoder_ids = torch.randint(3, 128, (2, 5))
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        model.set_attn_implementation(fa_hf.NAME)
        got = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_packed_positions_in_several_rows():
    # Position ids that restart inside rows of a batch of two (use_cache off, no mask): each sequence alone.
    model = model_pair("llama")
    model.set_attn_implementation(fa_hf.NAME)
    torch.manual_seed(4)
    rows = [[7, 5], [3, 9]]  # sequence lengths per row: 12 tokens each
    ids = torch.randint(0, 128, (2, 12))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    with torch.no_grad():
        got = model(ids, position_ids=positions, use_cache=False).logits
        for b, row in enumerate(rows):
            start = 0
            for n in row:
                alone = model(ids[b : b + 1, start : start + n]).logits[0]
                torch.testing.assert_close(got[b, start : start + n], alone, atol=2e-5, rtol=1e-4)
                start += n


def test_keys_past_the_queries_without_causal_are_all_seen():
    # Without a causal mask, keys beyond the queries are not a KV cache to cut by the positions: every key is seen.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 4, 10, 16), torch.randn(2, 4, 10, 16)
    got, _ = fa_hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=False,
                                     position_ids=torch.arange(3)[None])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-4)


def test_what_the_kernels_cannot_carry_raises():
    # A position bias added to the scores (T5), chunked attention past a chunk, and a model's own overlays on the
    # mask raise rather than compute another function (transformers refuses them only for "flash" names).
    q = torch.randn(1, 4, 6, 16)
    with pytest.raises(ValueError, match="position bias"):
        fa_hf.attention_forward(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1, 4, 6, 6))
    masks = transformers.masking_utils
    chunked = types.SimpleNamespace(attention_chunk_size=4)
    with pytest.raises(ValueError, match="chunked attention"):
        fa_hf.padding_mask(1, 6, 6, config=chunked)
    assert fa_hf.padding_mask(1, 4, 4, config=chunked) is None  # within one chunk: plain causal
    with pytest.raises(ValueError, match="overlays"):
        fa_hf.padding_mask(1, 6, 6, use_vmap=True)
    union = masks.or_masks(masks.causal_mask_function, masks.bidirectional_mask_function)
    with pytest.raises(ValueError, match="overlays"):
        fa_hf.padding_mask(1, 6, 6, mask_function=union)
    padding = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert torch.equal(fa_hf.padding_mask(1, 6, 6, attention_mask=padding.bool()), padding.bool())


def test_dropout_in_training_raises():
    config = transformers.LlamaConfig(**TINY, attention_dropout=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=fa_hf.NAME).train()
    with pytest.raises(ValueError, match="attention dropout"):
        model(torch.randint(0, 128, (1, 8)))


@pytest.mark.parametrize("per_sequence", [False, True], ids=["packed", "per-sequence"])
def test_training_step_gradients_match_eager(per_sequence, monkeypatch):
    # Right padding, as training batches have it: no real label is predicted from a padded position (whose output
    # differs between the paths and reaches no real token). per-sequence: the padded batch as one dense call per
    # sequence, the route of a CUDA backward that the packed kernels cannot take (forced here on the CPU).
    monkeypatch.setattr(fa_hf, "_per_sequence_calls", lambda q, k, v: per_sequence)
    model = model_pair("llama").train()
    ids, mask = padded_batch()
    mask = mask.flip(1)
    labels = ids.masked_fill(mask == 0, -100)
    ref = torch.autograd.grad(model(ids, attention_mask=mask, labels=labels).loss, list(model.parameters()))
    model.set_attn_implementation(fa_hf.NAME)
    got = torch.autograd.grad(model(ids, attention_mask=mask, labels=labels).loss, list(model.parameters()))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_logits_cuda_bf16(name):
    # bf16 on CUDA (padded batches run as packed sequences): against the eager path in fp32, within 3x the eager
    # path's own bf16 error (FlashAttention's rule).
    ids, mask = padded_batch("cuda")
    real = mask.bool()
    with torch.no_grad():
        ref = model_pair(name, "cuda", torch.float32)(ids, attention_mask=mask).logits[real]
        model = model_pair(name, "cuda", torch.bfloat16)
        eager_bf16 = model(ids, attention_mask=mask).logits[real].float()
        model.set_attn_implementation(fa_hf.NAME)
        got = model(ids, attention_mask=mask).logits[real].float()
    assert (got - ref).abs().max() <= 3 * (eager_bf16 - ref).abs().max() + 1e-3


def decode_logits(model, ids, mask, steps):
    """Logits of the prompt's last position and of `steps` decoding steps fed fixed tokens, over the model's cache."""
    torch.manual_seed(4)
    tokens = torch.randint(0, 128, (ids.shape[0], steps), device=ids.device)
    # transformers renamed the cache argument (past_key_values -> cache); the output keeps past_key_values.
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, attention_mask=mask, use_cache=True)
    logits, cache = [out.logits[:, -1]], out.past_key_values
    for t in range(steps):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out = model(tokens[:, t : t + 1], attention_mask=mask, use_cache=True, **{cache_argument: cache})
        logits.append(out.logits[:, -1])
        cache = out.past_key_values
    return torch.stack(logits, 1).float()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_left_padded_decoding_matches_eager(name):
    model = model_pair(name)
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = decode_logits(model, ids, mask, 5)
        model.set_attn_implementation(fa_hf.NAME)
        got = decode_logits(model, ids, mask, 5)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", [name for name in ("llama", "qwen2") if name in CONFIGS])
def test_decoding_over_a_mask_with_a_hole_matches_eager(name):
    # Padding inside a row is not left padding: each decoding step gathers the cache's real keys (a query row against
    # more keys), as the prompt's pass does. (A sliding window then spans real keys only, as in transformers' own
    # FlashAttention path, where the eager mask counts the hole: models without one here.)
    model = model_pair(name)
    ids, mask = padded_batch()
    mask[0, 8:11] = 0
    with torch.no_grad():
        ref = decode_logits(model, ids, mask, 3)
        model.set_attn_implementation(fa_hf.NAME)
        got = decode_logits(model, ids, mask, 3)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CONFIGS))
def test_left_padded_decoding_cuda_bf16(name):
    # Decoding steps over a left-padded batch's cache (read in place, from each row's first real key) in bf16 on CUDA:
    # against the eager path in fp32, within 3x the eager path's own bf16 error.
    ids, mask = padded_batch("cuda")
    with torch.no_grad():
        ref = decode_logits(model_pair(name, "cuda", torch.float32), ids, mask, 5)
        model = model_pair(name, "cuda", torch.bfloat16)
        eager_bf16 = decode_logits(model, ids, mask, 5)
        model.set_attn_implementation(fa_hf.NAME)
        got = decode_logits(model, ids, mask, 5)
    assert (got - ref).abs().max() <= 3 * (eager_bf16 - ref).abs().max() + 1e-3


@pytest.mark.parametrize("capability,built,switch,hopper", [
    ((9, 0), True, None, True), ((9, 0), True, "0", False), ((9, 0), False, None, False), ((8, 0), True, None, False)])
def test_hopper_routes_need_the_hopper_kernels(monkeypatch, capability, built, switch, hopper):
    # Long chunks read a left-padded cache in place, and packed batches above D128 get gradients from the packed
    # backward, only where the Hopper kernels may run: a Hopper GPU, a build that holds them, the switch not "0".
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(fa_hf, "_BUILT_HOPPER_KERNELS", built)
    for name in ("FLASHATTN_FWD_SM90", "FLASHATTN_BWD_SM90"):
        monkeypatch.delenv(name, raising=False) if switch is None else monkeypatch.setenv(name, switch)
    query = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(40, 4, 256))
    assert fa_hf._reads_cache_in_place(query, 40) == hopper
    assert fa_hf._reads_cache_in_place(query, 16)  # the decode path's rows, on any GPU
    assert fa_hf._packed_backward_takes(query) == hopper
    assert fa_hf._packed_backward_takes(types.SimpleNamespace(device=query.device, shape=(40, 4, 128)))


def test_a_build_without_cuda_kernels_has_no_hopper_kernels():
    if torch.ops.flashattn.cuda_head_dims():
        pytest.skip("a build with CUDA kernels")
    assert torch.ops.flashattn.cuda_hopper_kernels() is False
    assert fa_hf._BUILT_HOPPER_KERNELS is False


@pytest.mark.cuda
def test_left_padded_chunk_over_a_cache_cuda(monkeypatch):
    # A chunk of 40 new tokens over a left-padded batch's cache: on Hopper read in place (its TMA forward takes long
    # chunks), elsewhere the real rows gathered for the packed kernels; the same values either way.
    torch.manual_seed(5)
    batch, heads, heads_kv, len_q, len_k, head_dim = 3, 8, 2, 40, 100, 64
    query = torch.randn(batch, heads, len_q, head_dim, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(batch, heads_kv, len_k, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(batch, len_k, dtype=torch.long, device="cuda")
    pads = [0, 6, 55]
    for b, pad in enumerate(pads):
        mask[b, :pad] = 0
    calls = []
    kvcache = fa_hf.flash_attn_with_kvcache
    monkeypatch.setattr(fa_hf, "flash_attn_with_kvcache", lambda *a, **kw: calls.append(1) or kvcache(*a, **kw))
    got = fa_hf._attention(query, key, value, mask, True, None, None, None, None)
    assert bool(calls) == fa_hf._hopper_kernels(query.device, "FLASHATTN_FWD_SM90")
    monkeypatch.setattr(fa_hf, "_reads_cache_in_place", lambda *a: False)
    gathered = fa_hf._attention(query, key, value, mask, True, None, None, None, None)
    torch.testing.assert_close(got, gathered, rtol=2e-2, atol=2e-2)
    for b, pad in enumerate(pads):  # and right: each entry against the reference over its real keys
        q, k, v = query[b : b + 1], key[b : b + 1, :, pad:], value[b : b + 1, :, pad:]
        want, _ = attention_ref(q.float(), k.float(), v.float(), causal=True)
        low, _ = attention_ref(q, k, v, causal=True, upcast=False)
        assert_error_within(got[b : b + 1].transpose(1, 2), want, [low], None, f"entry {b}")


@pytest.mark.cuda
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_packed_gradients_above_d128_cuda(monkeypatch, deterministic):
    # Above D128 a batch that needs gradients runs packed where the packed backward takes it (Hopper's kernel), else
    # one dense call per sequence; both give the per-sequence gradients, deterministic or not.
    hopper_kernel = fa_hf._hopper_kernels(torch.device("cuda"), "FLASHATTN_BWD_SM90")
    calls = []
    for name in ("flash_attn", "flash_attn_varlen"):
        real = getattr(fa_hf, name)
        monkeypatch.setattr(fa_hf, name, lambda *a, _f=real, _name=name, **kw: calls.append(_name) or _f(*a, **kw))
    torch.manual_seed(4)
    lengths = [5, 130, 1, 64]
    q, k, v = (torch.randn(sum(lengths), heads, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (4, 2, 2))
    cu = fa_hf._cu_seqlens(torch.tensor(lengths, device="cuda"))
    dout = torch.randn_like(q)
    torch.use_deterministic_algorithms(deterministic)
    try:
        grads = torch.autograd.grad(fa_hf._packed_call(q, k, v, cu, cu, None, None, causal=True), (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert set(calls) == {"flash_attn_varlen" if hopper_kernel else "flash_attn"}
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        start += n
        seq = [t.detach()[rows].transpose(0, 1)[None].float().requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*seq, is_causal=True, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, seq, dout[rows].transpose(0, 1)[None].float())
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got[rows].float(), want[0].transpose(0, 1), atol=3e-2, rtol=3e-2)
