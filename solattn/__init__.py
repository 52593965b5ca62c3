"""solattn: exact FlashAttention for PyTorch, written in Python (Triton and Gluon).

Public API (flash-attn 2.x compatible, plus an SDPA-layout ``attention``)::

    from solattn import flash_attn_func, flash_attn_varlen_func, attention
    from solattn import flash_attn_with_kvcache, flash_attn_combine   # inference, KV caches
"""

from solattn.interface import attention, flash_attn_func, flash_attn_varlen_func
from solattn.kvcache import flash_attn_combine, flash_attn_with_kvcache

__all__ = ["attention", "flash_attn_combine", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache"]
__version__ = "0.1.0"
