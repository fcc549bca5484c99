"""flashattn_ext: FlashAttention for PyTorch as a C++/CUDA extension.

Importing the package loads the compiled library, which registers ``torch.ops.flashattn.*``.
The user-facing entry point is :func:`flash_attn`.
"""
__version__ = "0.1.0"

import torch  # noqa: F401  (first: the extension links against libtorch/libc10, which torch loads)

import importlib.util  # noqa: E402

if importlib.util.find_spec(f"{__name__}._C") is None:
    raise ImportError(
        "flashattn_ext: the compiled extension (flashattn_ext._C) is not built: pip install --no-build-isolation -e . "
        "in the checkout (or install a wheel built for this torch)."
    )
try:
    from . import _C  # noqa: F401,E402  (loads the library: runs TORCH_LIBRARY / TORCH_LIBRARY_IMPL registrations)
except ImportError as error:  # built against another torch
    raise ImportError(
        f"flashattn_ext: the compiled extension (flashattn_ext._C) did not load: {error}. It must be built against the "
        f"torch it runs with (this is torch {torch.__version__}): pip install --no-build-isolation -e . in the "
        "checkout (an installed copy is shadowed by the checkout's sources when Python starts there)."
    ) from error
from .ops import (  # noqa: E402
    flash_attn,
    flash_attn_varlen,
    flash_attn_varlen_with_lse,
    flash_attn_with_kvcache,
    flash_attn_with_lse,
)

from .ops import _refuse_cuda_tensors  # noqa: E402
from .integrations import sdpa as _sdpa  # noqa: E402

if not torch.ops.flashattn.cuda_head_dims():  # a build without CUDA kernels
    _refuse_cuda_tensors()

# Registers (never activates) the SDPA flash provider; users opt in with
# torch.nn.attention.activate_flash_attention_impl("flashattn_ext").
_sdpa.register()

__all__ = [
    "flash_attn", "flash_attn_with_lse", "flash_attn_varlen", "flash_attn_varlen_with_lse", "flash_attn_with_kvcache",
    "__version__",
]
