"""FlexAttention's API on solattn's portable kernels, no torch.compile needed.

Import-compatible with ``torch.nn.attention.flex_attention``::

    from solattn.flex import flex_attention, create_block_mask, and_masks, or_masks

``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are the same plain
PyTorch functions; solattn traces each once (torch.fx), generates a ``@triton.jit`` function for
it (and for its derivative), and runs solattn's portable forward/backward kernels on the blocks a
``BlockMask`` lists. See :mod:`solattn.flex.trace`, :mod:`solattn.flex.codegen`,
:mod:`solattn.flex.block_mask`, :mod:`solattn.flex.ops`.
"""

from solattn.flex.block_mask import (
    BlockMask,
    and_masks,
    create_block_mask,
    create_mask,
    noop_mask,
    or_masks,
)
from solattn.flex.ops import flex_attention
from solattn.flex.trace import UnsupportedModError

__all__ = ["BlockMask", "UnsupportedModError", "and_masks", "create_block_mask", "create_mask",
           "flex_attention", "noop_mask", "or_masks"]
