"""End to end: a tiny causal language model trained with flash_attn follows, step by step, the same model trained
with SDPA from the same initial weights (forward, backward and AdamW updates all have to agree), and its first step's
gradients are as close to SDPA's as SDPA's own math backend is."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext
from reference import flat_grads, relative_error, repeat_kv


class TinyLM(torch.nn.Module):
    """Embedding, one pre-norm transformer block (causal self-attention with optional GQA, MLP), LM head."""

    def __init__(self, vocab=97, dim=64, heads=4, heads_kv=2, attention="flash"):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.attention = attention
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(128, dim))
        self.norm_attn = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.norm_mlp = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.norm_out = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def attend(self, q, k, v):
        if self.attention == "flash":
            return flashattn_ext.flash_attn(q, k, v, causal=True)
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # Lq == Lk: the same mask as ours

    def forward(self, tokens):
        batch, length = tokens.shape
        x = self.embed(tokens) + self.pos[:length]
        h = self.norm_attn(x)
        q = self.q(h).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(batch, length, 2, self.heads_kv, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = self.attend(q, k, v).transpose(1, 2).reshape(batch, length, -1)
        x = x + self.proj(attn)
        x = x + self.mlp(self.norm_mlp(x))
        return self.head(self.norm_out(x))


def next_token_loss(model, tokens, autocast_dtype):
    with torch.autocast(tokens.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def train(model, tokens, steps, autocast_dtype=None):
    """Next-token prediction with AdamW; returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        loss = next_token_loss(model, tokens, autocast_dtype)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def first_step_grads(model, tokens, autocast_dtype):
    """Every parameter's gradient of the first step, flattened (float32); the model is left without gradients."""
    next_token_loss(model, tokens, autocast_dtype).backward()
    grads = flat_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_training_matches_sdpa(device, dtype, heads_kv):
    flash_model = TinyLM(heads_kv=heads_kv).to(device)
    sdpa_model = copy.deepcopy(flash_model)
    sdpa_model.attention = "sdpa"
    tokens = torch.randint(0, 97, (4, 49), device=device)
    autocast_dtype = None if dtype == torch.float32 else dtype  # float32 master weights, bf16 matmuls/attention

    # The losses at random weights barely depend on the attention (hiding each row's diagonal key moves them by 0.35%
    # under bf16); the first step's gradients move by 7%, 30x the distance of SDPA's math backend from its default.
    math_model = copy.deepcopy(sdpa_model)
    with sdpa_kernel(SDPBackend.MATH):
        math_grads = first_step_grads(math_model, tokens, autocast_dtype)
    sdpa_grads = first_step_grads(sdpa_model, tokens, autocast_dtype)
    flash_grads = first_step_grads(flash_model, tokens, autocast_dtype)
    noise = relative_error(math_grads, sdpa_grads)
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    error = relative_error(flash_grads, sdpa_grads)
    assert error <= 3 * noise + floor, f"gradients {error:.2e} from SDPA's, its math backend's {noise:.2e}"

    flash_losses = train(flash_model, tokens, 8, autocast_dtype)
    sdpa_losses = train(sdpa_model, tokens, 8, autocast_dtype)

    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    for step, (ours, theirs) in enumerate(zip(flash_losses, sdpa_losses)):
        assert abs(ours - theirs) <= rtol * abs(theirs), f"step {step}: loss {ours} (flash) vs {theirs} (SDPA)"
    assert flash_losses[-1] < flash_losses[0] - 0.1, f"the model did not learn: {flash_losses}"
