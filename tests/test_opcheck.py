"""Dispatcher integration: torch.library.opcheck (schema, fake impl, autograd registration, AOT dispatch) and
torch.compile(fullgraph=True) against eager."""
import pytest
import torch

import flashattn_ext
from reference import sample_inputs

SAMPLE_IDS = ["basic", "gqa-causal", "mqa-causal-scale-no-keys", "decode-strided", "packed-causal"]


@pytest.mark.dtypes(cpu=[torch.float32, torch.bfloat16], cuda=[torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sample", range(len(SAMPLE_IDS)), ids=SAMPLE_IDS)
def test_opcheck(device, dtype, sample):
    args, kwargs = sample_inputs(device, dtype)[sample]
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args, kwargs)


def attention_block(q, k, v):
    # Ops around the call so the compiled graph has more than the custom op in it.
    out, lse = flashattn_ext.flash_attn_with_lse(q * 1.5, k, v, causal=True, scale=0.2)
    return flashattn_ext.flash_attn(out, k, v) + 1, lse.exp()


@pytest.mark.dtypes(cpu=[torch.float32], cuda=[torch.bfloat16])
def test_compile_fullgraph(device, dtype):
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True)
    # Two shapes: the second one recompiles (or runs a dynamic-shape graph) through the fake impl again.
    for args, _ in sample_inputs(device, dtype)[1:3]:
        expected_out, expected_lse = attention_block(*args)
        out, lse = compiled(*args)
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(lse, expected_lse)
