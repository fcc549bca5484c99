"""What a careful user relies on beyond plain accuracy, on every path (CPU; on CUDA the default kernels, and under the
strict switches of .ci/gpu-check the Hopper and the sm80 ones; the fused and the chunked backward):

- non-finite inputs: a NaN reaches every row that sees it (out and lse NaN, gradients NaN), never disguised as a row
  without keys (lse = -inf is reserved for those); infinite scores follow softmax (inf - inf is NaN, -inf weighs 0);
- every finite scale: tiny ones (float32 denormals, values that round to 0) give the uniform softmax; one whose
  scale * log2(e) does not fit in float32 is refused (test_errors.py);
- autocast: under torch.autocast the op runs in the autocast dtype, as SDPA does;
- batch invariance: a sequence's out and lse (and, with deterministic algorithms, its gradients) are the same bits in
  any batch.
"""
import pytest
import torch

import flashattn_ext
from cases import STREAM_K_MIN_BLOCKS, hopper_forward, stream_k_tiles
from isolated import run_isolated
from reference import (assert_attention_close, assert_grads_close, attention_ref, leaves, make_qkv, rows_with_keys,
                       visible_mask)

fwd = torch.ops.flashattn.fwd
bwd = torch.ops.flashattn.bwd
NAN = float("nan")
INF = float("inf")

# Shapes that take each CUDA kernel through more than one tile and key block (Hopper: 128-/192-row tiles, 64-, 80- and
# 128-key blocks), and, causal with Lq > Lk, rows without keys next to rows with them.
SHAPES = [(200, 200), (150, 300), (100, 60)]
SHAPE_IDS = ["q200-k200", "q150-k300", "q100-k60"]


def close_to(actual, expected):
    """Equal up to the rounding of a kernel that saw other rows change (NaN where expected is NaN)."""
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=1e-2, atol=1e-2)


# ---- non-finite inputs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_nan_in_query_row(device, dtype, head_dim, len_q, len_k, causal):
    # Its scores are all NaN: that row's out and lse are NaN, every other row is as without the NaN, and the rows that
    # see no key still give 0 and -inf.
    q, k, v = make_qkv(1, 2, 1, len_q, len_k, head_dim, dtype, device)
    clean_out, clean_lse = fwd(q, k, v, causal)
    row = len_q - 3
    q[0, 1, row, head_dim // 2] = NAN
    out, lse = fwd(q, k, v, causal)
    assert out[0, 1, row].isnan().all() and lse[0, 1, row].isnan(), "the NaN row must be NaN in out and lse"
    others = torch.ones_like(lse, dtype=torch.bool)
    others[0, 1, row] = False
    close_to(out[others], clean_out[others])
    close_to(lse[others], clean_lse[others])
    keyless = ~rows_with_keys(len_q, len_k, causal, device)
    assert (lse[:, :, keyless] == -INF).all() and (out[:, :, keyless] == 0).all()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("len_q,len_k", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_nan_in_key(device, dtype, head_dim, len_q, len_k, causal, where):
    # A NaN in key j (of a kv head that two query heads share): every row that sees j is NaN in out and lse; a row
    # that does not see j (causal) is as before. The mask replaces j's score in those rows, so no NaN reaches them.
    # The first key leads its key block on every backend: a row maximum that skips the NaN must not drop the block.
    q, k, v = make_qkv(1, 4, 2, len_q, len_k, head_dim, dtype, device)
    clean_out, clean_lse = fwd(q, k, v, causal)
    j = {"first": 0, "middle": len_k // 2, "last": len_k - 1}[where]
    k[0, 1, j, 0] = NAN
    out, lse = fwd(q, k, v, causal)
    sees_j = visible_mask(len_q, len_k, causal, device)[:, j]
    assert sees_j.any()
    for head in (2, 3):  # the query heads of kv head 1
        assert out[0, head, sees_j].isnan().all() and lse[0, head, sees_j].isnan().all()
        close_to(out[0, head, ~sees_j], clean_out[0, head, ~sees_j])
        close_to(lse[0, head, ~sees_j], clean_lse[0, head, ~sees_j])
    close_to(out[0, :2], clean_out[0, :2])  # kv head 0's query heads never see the NaN
    assert torch.equal(lse[0, :2], clean_lse[0, :2])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_nan_in_value(device, dtype, head_dim, causal):
    # A NaN in column c of value j: column c of every row that sees j is NaN, its other columns and lse are not.
    # (Where a row that does not see j shares j's key block with one that does, CUDA's 0 * NaN may reach it too.)
    len_q = len_k = 200
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, head_dim, dtype, device)
    clean_out, clean_lse = fwd(q, k, v, causal)
    j, c = 150, 5
    v[0, 0, j, c] = NAN
    out, lse = fwd(q, k, v, causal)
    sees_j = visible_mask(len_q, len_k, causal, device)[:, j]
    assert out[0, 0, sees_j, c].isnan().all()
    others = torch.ones(head_dim, dtype=torch.bool, device=device)
    others[c] = False
    close_to(out[0, 0][sees_j][:, others], clean_out[0, 0][sees_j][:, others])
    assert torch.equal(lse, clean_lse), "lse does not depend on v"


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_nan_row_gradients(device, dtype, head_dim, causal, deterministic):
    # The gradients of a NaN row are NaN on every backward path (the fused kernels, and the chunked one that
    # deterministic=True takes on CUDA): its dq row, and dk, dv of every key it sees; the other rows' dq stay finite.
    len_q = len_k = 130
    q, k, v = make_qkv(1, 2, 1, len_q, len_k, head_dim, dtype, device)
    row = 100
    q[0, 0, row, 3] = NAN
    out, lse = fwd(q, k, v, causal)
    dout = torch.randn_like(out)
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, causal, None, None, deterministic)
    assert dq[0, 0, row].isnan().all(), "dq of the NaN row"
    seen = visible_mask(len_q, len_k, causal, device)[row]
    assert dk[0, 0, seen].isnan().all() and dv[0, 0, seen].isnan().all(), "dk, dv of the keys the NaN row sees"
    finite = torch.ones(len_q, dtype=torch.bool, device=device)
    finite[row] = False
    assert dq[0, 0, finite].isfinite().all() and dq[0, 1].isfinite().all()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_infinite_scores(device, dtype, head_dim):
    # Head 0: row 5's scores are all +inf (inf - inf: NaN), row 9's all -inf (0 / 0: NaN), as in softmax; neither is
    # reported as a row without keys. Head 1: key 7's score is -inf in every row, so it weighs 0 and the result is
    # attention over the other keys.
    len_q = len_k = 150
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, head_dim, dtype, device)
    k[..., 0] = k[..., 0].abs() + 0.5
    q[0, 0, 5, 0], q[0, 0, 9, 0] = INF, -INF
    q[0, 1, :, 0] = q[0, 1, :, 0].abs() + 0.5
    k[0, 1, 7, 0] = -INF
    out, lse = fwd(q, k, v)
    for row in (5, 9):
        assert out[0, 0, row].isnan().all() and lse[0, 0, row].isnan(), f"row {row}"
    rows = ~torch.isin(torch.arange(len_q, device=device), torch.tensor([5, 9], device=device))
    assert_attention_close(out[:, :1, rows], lse[:, :1, rows], q[:, :1, rows], k[:, :1], v[:, :1])  # no mask: any rows
    keep = torch.arange(len_k, device=device) != 7
    assert_attention_close(out[:, 1:], lse[:, 1:], q[:, 1:], k[:, 1:, keep], v[:, 1:, keep])


def test_leading_key_blocks_of_minus_inf_scores_weigh_nothing(device, dtype):
    # Keys 0 .. 199 score -inf in every row (whole first key blocks of every kernel): they weigh 0 and the rows attend
    # over the rest, not NaN (an online softmax whose history is -inf must not form exp(-inf - -inf)). With every key at
    # -inf a row is NaN, as softmax gives, unless a sink takes the whole weight: out 0, lse = the sink.
    len_q, len_k = 70, 400
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, 64, dtype, device)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[:, :, :200, 0] = -INF
    out, lse = fwd(q, k, v)
    assert_attention_close(out, lse, q, k[:, :, 200:], v[:, :, 200:])
    k[:, :, 200:, 0] = -INF
    out, lse = fwd(q, k, v)
    assert out.isnan().all() and lse.isnan().all()
    sinks = torch.tensor([0.5, -1.0], device=device)
    out, lse = fwd(q, k, v, sinks=sinks)
    assert (out == 0).all() and torch.equal(lse, sinks[None, :, None].expand_as(lse))


# ---- scale ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [1e-40, 1e-300, -1e-300, 0.0, -0.0], ids=["1e-40", "1e-300", "-1e-300", "0", "-0"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tiny_scale_is_uniform(device, dtype, head_dim, scale, causal):
    # A scale too small for a normal float32 (a denormal, one that rounds to 0, 0 itself): every scaled score is 0, so
    # each row averages the values it sees and lse = log(keys seen).
    len_q, len_k = 150, 300
    q, k, v = make_qkv(1, 2, 2, len_q, len_k, head_dim, dtype, device)
    out, lse = fwd(q, k, v, causal, scale)
    ref_out, ref_lse = attention_ref(q, k, v, causal, 0.0)
    torch.testing.assert_close(out.to(ref_out.dtype), ref_out, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16])  # float64's baseline (the reference's own GEMM) is exact
@pytest.mark.parametrize("scale", [1e3, -1e3])
def test_large_scale(device, dtype, scale):
    # Nearly one-hot rows (scaled scores in the thousands).
    q, k, v = make_qkv(1, 2, 2, 129, 200, 64, dtype, device)
    out, lse = fwd(q, k, v, True, scale)
    if not (device == "cuda" and dtype == torch.float16):
        assert_attention_close(out, lse, q, k, v, True, scale)
        return
    # The documented limit: the CUDA kernels form each exponent as fma(s, scale*log2e, -rowmax*scale*log2e) in
    # float32, as FlashAttention does. Here |rowmax*scale*log2e| is about 3e4 (ulp 2e-3), which moves a row's weights
    # by up to 0.07%: more than half an fp16 ulp of out (so PyTorch's one-hot fp16 result can be nearer), less than two.
    ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), True, scale)
    keyed = rows_with_keys(q.shape[2], k.shape[2], True, device)
    err = (out.double() - ref_out)[:, :, keyed].abs().max().item()
    assert err <= 2**-9 * ref_out[:, :, keyed].abs().max().item(), f"out: max abs error {err:.3e}"
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)


# ---- autocast -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", ["fp32", "fp32-qk"], ids=["fp32-qkv", "fp32-qk-low-v"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast(device, low, mix):
    # Under torch.autocast(device, low): fp32 q, k, v (or fp32 q, k after a QK-norm with a v already in `low`) are
    # cast to `low`, the op runs in it, and the gradients reach the inputs in their own dtypes; the same bits as
    # casting by hand.
    q, k, v = make_qkv(2, 4, 2, 70, 90, 64, torch.float32, device)
    if mix == "fp32-qk":
        v = v.to(low)
    q, k, v = leaves(q, k, v)
    with torch.autocast(device, dtype=low):
        out = flashattn_ext.flash_attn(q, k, v, causal=True)
    assert out.dtype == low
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.dtype for g in grads] == [q.dtype, k.dtype, v.dtype]

    q2, k2, v2 = leaves(q, k, v)
    out_by_hand = flashattn_ext.flash_attn(q2.to(low), k2.to(low), v2.to(low), causal=True)
    assert torch.equal(out, out_by_hand)
    for got, want in zip(grads, torch.autograd.grad(out_by_hand, (q2, k2, v2), dout)):
        assert torch.equal(got, want)


def test_autocast_leaves_float64_and_lse(device):
    # As for SDPA, float64 is not autocast (on CPU it runs in float64); lse stays float32 in every case.
    if device == "cpu":
        q, k, v = make_qkv(1, 2, 2, 9, 11, 16, torch.float64, device)
        with torch.autocast(device, dtype=torch.bfloat16):
            out, lse = flashattn_ext.flash_attn_with_lse(q, k, v)
        assert out.dtype == torch.float64 and lse.dtype == torch.float32
    q, k, v = make_qkv(1, 2, 2, 9, 11, 16, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out, lse = flashattn_ext.flash_attn_with_lse(q, k, v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_autocast_compiles(device):
    # torch.compile(fullgraph=True) traces the autocast rule with the rest.
    q, k, v = make_qkv(1, 2, 2, 33, 33, 32, torch.float32, device)

    def step(q, k, v):
        with torch.autocast(device, dtype=torch.bfloat16):
            return flashattn_ext.flash_attn(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, step(q, k, v))


# ---- batch invariance ---------------------------------------------------------------------------------------------

# D128 without a mask at L 2048 with 8 heads: 128 tiles of 128 rows per sequence, 16 key blocks each, so on a 132-SM
# Hopper a batch of 5 or 16 leaves a last round that the stream-K split would share out over the CTAs (tile_scheduler.h:
# stream_k_tiles), each batch size differently.
INVARIANCE = dict(heads=8, len_q=2048, len_k=2048, head_dim=128)


def batch_of(device, dtype, batch, seed, len_q, len_k, heads, head_dim):
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    return [randn(batch, heads, n, head_dim) for n in (len_q, len_k, len_k)]


def stream_k_would_split(batch, device):
    """Whether the D128 Hopper forward's stream-K split, when allowed, would apply to a batch of INVARIANCE."""
    if device != "cuda" or not hopper_forward():
        return False
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = batch * INVARIANCE["heads"] * INVARIANCE["len_q"] // 128
    return stream_k_tiles(tiles, num_sms, INVARIANCE["len_k"] // 128, STREAM_K_MIN_BLOCKS) > 0


def with_sequence_last(device, dtype, batch, seed, shape):
    """A batch of `batch` random sequences whose last is sequence 0 of seed 0, the one compared: the stream-K split
    would share out the batch's last tiles, which are its tiles."""
    q, k, v = batch_of(device, dtype, batch, seed, **shape)
    q[-1], k[-1], v[-1] = (t[0] for t in batch_of(device, dtype, 1, 0, **shape))
    return q, k, v


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_batch_invariant(device, dtype, causal):
    # One sequence alone, last in a batch of 5 and last in a batch of 16 (the others differ each time): the same bits.
    shape = INVARIANCE if device == "cuda" else dict(heads=2, len_q=100, len_k=130, head_dim=64)
    alone = fwd(*with_sequence_last(device, dtype, 1, 0, shape), causal)
    for batch, seed in ((5, 1), (16, 2)):
        q, k, v = with_sequence_last(device, dtype, batch, seed, shape)
        out, lse = fwd(q, k, v, causal)
        assert torch.equal(out[-1:], alone[0]) and torch.equal(lse[-1:], alone[1]), f"batch of {batch}"
        if not causal and stream_k_would_split(batch, device):
            # The test can fail: the batch-dependent split (forced, in a process of its own) does change that
            # sequence's bits.
            [(split_out, _, _)] = run_isolated({"FLASHATTN_FWD_SCHEDULE": "stream-k"}, "cuda_kernels.schedule_runs",
                                               "forward_each", [(q, k, v, False, None)])
            assert not torch.equal(split_out[-1:], out[-1:])


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_fwd_expanded_keys_batch_invariant(device, dtype):
    # Keys and values that every entry shares as an expanded view (batch stride 0, as a common prefix): each entry has
    # the bits it has alone, whichever kernel the strides allow (a TMA map of a zero stride must not decide it).
    gen = torch.Generator(device=device).manual_seed(0)
    k, v = (torch.randn(1, 4, 300, 128, device=device, dtype=dtype, generator=gen) for _ in range(2))
    q = torch.randn(3, 4, 200, 128, device=device, dtype=dtype, generator=gen)
    out, lse = fwd(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), True)
    for b in range(3):
        alone = fwd(q[b : b + 1], k, v, True)
        assert torch.equal(out[b : b + 1], alone[0]) and torch.equal(lse[b : b + 1], alone[1]), f"entry {b}"


def switch_probe():
    """Run in a process with FLASHATTN_BATCH_INVARIANT set: whether a sequence last in a batch of 16 has the bits it has
    alone, with the default algorithms and then deterministic ones."""
    alone = fwd(*with_sequence_last("cuda", torch.bfloat16, 1, 0, INVARIANCE))[0]
    q, k, v = with_sequence_last("cuda", torch.bfloat16, 16, 2, INVARIANCE)
    fast = fwd(q, k, v)[0]
    torch.use_deterministic_algorithms(True)
    invariant = fwd(q, k, v)[0]
    return torch.equal(fast[-1:], alone), torch.equal(invariant[-1:], alone)


@pytest.mark.cuda
def test_fwd_batch_invariance_switch():
    # FLASHATTN_BATCH_INVARIANT=0 (read once, hence a fresh process) allows the faster batch-dependent split, except
    # under torch.use_deterministic_algorithms(True); any value but 0 or 1 is refused at the first call.
    env = {"FLASHATTN_BATCH_INVARIANT": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    fast_equal, invariant_equal = run_isolated(env, "op.test_robustness", "switch_probe")
    assert invariant_equal
    assert fast_equal == (not stream_k_would_split(16, "cuda"))
    with pytest.raises(RuntimeError, match="FLASHATTN_BATCH_INVARIANT must be one of 0, 1"):
        run_isolated({"FLASHATTN_BATCH_INVARIANT": "yes"}, "op.test_robustness", "switch_probe")


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 256], ids=["d64", "d256"])  # D256 without a mask: batches take turns
def test_bwd_batch_invariant_when_deterministic(device, dtype, causal, head_dim, deterministic_algorithms):
    # With deterministic algorithms a sequence's gradients are the same bits alone and inside a batch of 3.
    shape = dict(heads=4, len_q=300, len_k=300, head_dim=head_dim)

    def grads(batch, seed):
        q, k, v = with_sequence_last(device, dtype, batch, seed, shape)
        out, lse = fwd(q, k, v, causal)
        generator = torch.Generator(device=device).manual_seed(seed + 100)
        dout = torch.randn(out.shape, generator=generator, device=device).to(dtype)
        dout[-1] = torch.randn(out[0].shape, generator=torch.Generator(device=device).manual_seed(7), device=device)
        return [g[-1:] for g in bwd(dout, q, k, v, out, lse, causal, None, None, True)[:3]]

    for alone, batched in zip(grads(1, 0), grads(3, 5)):
        assert torch.equal(alone, batched)



def fresh_thread_calls(q, k, v, dout):
    """Run in a process of its own: the first forward on a thread that has done no CUDA work, then the first backward
    (autograd runs it on a thread of its own). A forward on the main thread first leaves the output's memory cached,
    so that the new thread's first CUDA work is the call itself."""
    import threading

    flashattn_ext.flash_attn(q, k, v, causal=True)
    q, k, v = leaves(q, k, v)
    result = {}

    def forward():
        try:
            result["out"] = flashattn_ext.flash_attn_with_lse(q, k, v, causal=True)
        except RuntimeError as error:
            result["error"] = error

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    out, lse = result["out"]
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.dtypes(cpu=[], cuda=[torch.bfloat16])
def test_first_call_on_a_new_thread_takes_the_hopper_kernels(device, dtype):
    # A thread's first CUDA work may be our call, before any context is current on it (autograd's backward thread):
    # the Hopper kernels' TMA maps must still encode, so that strict mode does not raise, and the results are right.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels")
    q, k, v = make_qkv(1, 4, 2, 300, 300, 128, dtype, device)
    dout = torch.randn_like(q)
    env = {"FLASHATTN_FWD_SM90": "strict", "FLASHATTN_BWD_SM90": "strict"}
    out, lse, *grads = run_isolated(env, "op.test_robustness", "fresh_thread_calls", q, k, v, dout)
    assert_attention_close(out, lse, q, k, v, True)
    assert_grads_close(grads, q, k, v, dout, None, True)
