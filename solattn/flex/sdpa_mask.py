"""SDPA's ``attn_mask`` as FlexAttention mods: how :func:`solattn.attention` takes a mask tensor.

``torch.nn.functional.scaled_dot_product_attention`` accepts a boolean mask (True: the query
attends to the key) or a float mask added to the scaled scores, of any shape broadcastable to
``(B, H, L, S)``. Here the mask's non-broadcast dims are gathered per score, from the mask as
given (no broadcast copy): a boolean mask becomes a ``mask_mod``, a float one a ``score_mod``
plus a ``mask_mod`` true where it is finite. ``create_block_mask`` then lists, per block, whether
it is empty (skipped), full (run without evaluating the mask) or partial, so a padding mask
costs only its partial blocks. The mods are partials of module-level functions: a new mask of the
same dtype and shape reuses the compiled kernels (:mod:`solattn.flex.trace` caches by code,
dtypes and shapes, never by values). The BlockMask of a mask tensor is kept while the same tensor
object comes back unmodified (a model passes one mask to every layer): keyed by the object
(a weak reference, so a new tensor at a freed one's address is never taken for it) and its
version counter (in-place writes bump it).
"""

from __future__ import annotations

import collections
import functools
import weakref

import torch

from solattn.flex.block_mask import create_block_mask


def _pick(kept, b, h, q_idx, kv_idx):
    """The index of a score's mask entry: the indices of the mask's non-broadcast dims."""
    return tuple(i for i, keep in zip((b, h, q_idx, kv_idx), kept) if keep)


def sdpa_bool_mask(table, kept, b, h, q_idx, kv_idx):
    return table[_pick(kept, b, h, q_idx, kv_idx)]


def sdpa_additive_mask(table, kept, score, b, h, q_idx, kv_idx):
    return score + table[_pick(kept, b, h, q_idx, kv_idx)]


def sdpa_finite_mask(table, kept, b, h, q_idx, kv_idx):
    return table[_pick(kept, b, h, q_idx, kv_idx)] > float("-inf")


# (id, version, B, H, L, S, device) -> (weak reference to the mask tensor, BlockMask); a few
# entries (one per mask a model uses, e.g. full and sliding-window layers).
_BLOCK_MASKS: collections.OrderedDict = collections.OrderedDict()
_MAX_BLOCK_MASKS = 4


def _block_mask(attn_mask, mask_mod, kept, B, H, L, S, device):
    """create_block_mask of ``mask_mod``, reused while ``attn_mask`` is the same, unmodified
    tensor."""
    key = (id(attn_mask), attn_mask._version, B, H, L, S, device)
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0]() is attn_mask:
        _BLOCK_MASKS.move_to_end(key)
        return hit[1]
    block_mask = create_block_mask(mask_mod, B if kept[0] else None, H if kept[1] else None,
                                   L, S, device=device)
    _BLOCK_MASKS[key] = (weakref.ref(attn_mask), block_mask)
    while len(_BLOCK_MASKS) > _MAX_BLOCK_MASKS:
        _BLOCK_MASKS.popitem(last=False)
    return block_mask


@torch.compiler.disable
def masked_attention(q, k, v, attn_mask, *, scale=None, enable_gqa=False, dropout_p=0.0):
    """SDPA with ``attn_mask`` on solattn's flex kernels; ``q (B, H, L, E)``, ``k``/``v (B,
    H_kv, S, E[v])``, the mask validated by :func:`solattn.validation.check_attn_mask`.
    Differentiable in q, k, v and a float mask that requires grad (fp32 atomics). A query row
    whose keys are all masked gets 0 (SDPA's math backend gives NaN). Under ``torch.compile`` it
    runs eagerly: a graph break (``fullgraph=True`` raises)."""
    from solattn.flex.ops import flex_attention

    B, H, L, _ = q.shape
    S = k.shape[2]
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    kept = tuple(m != 1 for m in mask.shape)
    if not any(kept):  # one value for every score: index it by query row
        mask, kept = mask.expand(1, 1, L, 1), (False, False, True, False)
    table = mask.reshape(tuple(n for n, keep in zip(mask.shape, kept) if keep))
    if attn_mask.dtype == torch.bool:
        score_mod, mask_mod = None, functools.partial(sdpa_bool_mask, table, kept)
    else:
        score_mod = functools.partial(sdpa_additive_mask, table, kept)
        mask_mod = functools.partial(sdpa_finite_mask, table, kept)
    block_mask = _block_mask(attn_mask, mask_mod, kept, B, H, L, S, q.device)
    options = {"dropout_p": dropout_p} if dropout_p else None
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=options)
