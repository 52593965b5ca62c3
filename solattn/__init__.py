"""solattn: exact FlashAttention for PyTorch, written in Python (Triton and Gluon).

Public API (flash-attn 2.x compatible, plus an SDPA-layout ``attention``)::

    from solattn import flash_attn_func, flash_attn_varlen_func, attention
    from solattn import flash_attn_qkvpacked_func, flash_attn_kvpacked_func  # and _varlen_*
    from solattn import flash_attn_with_kvcache, flash_attn_combine   # inference, KV caches

and FlexAttention's (``torch.nn.attention.flex_attention``'s names, no torch.compile needed)::

    from solattn import flex_attention, create_block_mask, BlockMask, and_masks, or_masks
"""

from solattn.interface import (
    attention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from solattn.kvcache import flash_attn_combine, flash_attn_with_kvcache

_FLEX = ("BlockMask", "and_masks", "create_block_mask", "create_mask", "flex_attention",
         "noop_mask", "or_masks")

__all__ = ["attention", "flash_attn_combine", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache", *_FLEX]
__version__ = "0.1.0"


def __getattr__(name):
    """The FlexAttention names load :mod:`solattn.flex` (torch.fx tracing, codegen) on first use."""
    if name in _FLEX:
        import solattn.flex

        return getattr(solattn.flex, name)
    raise AttributeError(f"module 'solattn' has no attribute {name!r}")
