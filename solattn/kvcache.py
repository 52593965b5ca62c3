"""Inference entry points: attention over a KV cache (``flash_attn_with_kvcache``) and the merge
of partial attention states (``flash_attn_combine``).

``flash_attn_with_kvcache`` is validation -> the ``torch.library.custom_op``
``solattn::kvcache_fwd`` (mutates the caches; a fake implementation lets
``torch.compile(fullgraph=True)`` trace it) -> one of two paths:

* **one fused launch** (:class:`~solattn.kernels.triton.decode.FusedDecode`): the split-KV
  decode kernel appends the new k/v itself (each token by the split that reads it), attends,
  and the last split of each (batch, kv head) to finish merges the splits' partials. Every call
  without rotary whose ``seqlen_q * group`` query rows fit one program per kv head (decode,
  speculative decoding), or that appends nothing.
* **separate launches** for the rest (rotary embedding, chunked prefill with many query rows):
  (rotary q, append k/v in place) -> split-KV attention (:mod:`solattn.kernels.triton.decode`)
  -> combine (:mod:`solattn.kernels.triton.combine`). :func:`separate_launches` forces this path
  (tests and benchmarks compare the two).

An eager CUDA call whose tensor metadata and arguments were seen before skips validation and
goes straight to its cached fused plan: one ``torch.empty`` (the output; the lse too with
``return_lse``) and one launch. It never copies device values to the host (no synchronization,
CUDA-graph capturable): checks of *values* (cache lengths within the cache, page numbers in
range) run only for tensors that live on the CPU (Triton's interpreter) outside tracing; on a
GPU they are the caller's contract, as in flash-attn.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor

from solattn import validation as V
from solattn.device import device_arch, num_sms
from solattn.launch import PlanCache
from solattn.params import decode_params as _params
from solattn.params import softmax_scale_or_default
from solattn.sinks import apply_sinks

_INT32 = torch.int32


def _host_values(t: torch.Tensor):
    """Values of ``t`` if reading them is free (a CPU tensor, not being traced), else None."""
    if V.values_unreadable(t):
        return None
    return t.tolist()


def _check_paged(k_cache, v_cache, block_table, batch, device):
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table: expected a torch.Tensor or None, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != _INT32:
        raise TypeError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected shape ({batch}, max_pages_per_seq), "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table: expected device {device}, got {block_table.device}")
    page = k_cache.shape[1]
    if page < 1 or page & (page - 1):
        raise ValueError(f"k_cache: expected a page size (k_cache.shape[1], with block_table) "
                         f"that is a power of two >= 1, got {page}")
    vals = _host_values(block_table)
    if vals is not None and block_table.numel():
        lo = min(min(r) for r in vals) if vals and vals[0] else 0
        hi = max(max(r) for r in vals) if vals and vals[0] else 0
        if lo < 0 or hi >= k_cache.shape[0]:
            raise ValueError(f"block_table: expected page numbers in [0, {k_cache.shape[0]}) "
                             f"(k_cache.shape[0] pages), got values in [{lo}, {hi}]")
    return block_table.contiguous()


def _check_capacity(cache_seqlens, s_new: int, block_table, page_size: int) -> None:
    """flash-attn's check of a paged call (``mha_fwd_kvcache``): the keys of every sequence,
    ``cache_seqlens[b] + seqlen_new``, must fit the ``block_table.shape[1] * page_size`` keys a
    block-table row addresses, else :class:`~solattn.validation.BlockTableCapacityError` (a
    ``RuntimeError`` naming block_table, as flash-attn's). Like flash-attn it reads
    ``max(cache_seqlens)`` on the host, synchronizing on a GPU; not while torch.compile traces
    or a CUDA graph is captured (no host read is possible there), where the kernels' clamping
    keeps an overflow inside the cache."""
    if cache_seqlens.numel() == 0 or torch.compiler.is_compiling() or (
            cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    longest = int(cache_seqlens.max()) + s_new
    capacity = block_table.shape[1] * page_size
    if longest > capacity:
        new = " + seqlen_new" if s_new else ""
        raise V.BlockTableCapacityError(
            f"cache_seqlens: expected max(cache_seqlens){new} <= {capacity}, the keys block_table "
            f"addresses (block_table.shape[1] * page_size = {block_table.shape[1]} * "
            f"{page_size}), got {longest}; allocate more block_table columns")


def _check_rotary(rotary_cos, rotary_sin, k, d, device):
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos/rotary_sin: expected both or neither, got "
                         f"rotary_cos={'set' if rotary_cos is not None else None}, "
                         f"rotary_sin={'set' if rotary_sin is not None else None}")
    if rotary_cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos: rotary embedding applies to new tokens: expected k and v "
                         "to be given with rotary_cos/rotary_sin, got k=None")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        V.check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin: expected shape {tuple(rotary_cos.shape)} (rotary_cos's), "
                         f"got {tuple(rotary_sin.shape)}")
    rot = 2 * rotary_cos.shape[1]
    if rot < 2 or rot > d:
        raise ValueError(f"rotary_cos: expected rotary_dim = 2 * rotary_cos.shape[1] in [2, {d}] "
                         f"(headdim), got {rot}")


def _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, block_table, softmax_scale, window_size,
                   softcap, alibi_slopes, num_splits):
    """Validate every argument; return ``(cache_seqlens, batch_idx, leftpad, table)`` normalized."""
    V.check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, nheads_kv, headdim)" if paged else \
        "(batch_cache, seqlen_cache, nheads_kv, headdim)"
    V.check_tensor("k_cache", k_cache, 4, cache_layout)
    V.check_tensor("v_cache", v_cache, 4, cache_layout.replace("headdim)", "headdim_v)"))
    if (k is None) != (v is None):
        raise ValueError("k/v: expected both new k and v, or neither, got "
                         f"k={'set' if k is not None else None}, "
                         f"v={'set' if v is not None else None}")
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    if k is not None:
        V.check_tensor("k", k, 4, "(batch, seqlen_new, nheads_kv, headdim)")
        V.check_tensor("v", v, 4, "(batch, seqlen_new, nheads_kv, headdim_v)")
        tensors.update(k=k, v=v)
    V.check_dtypes(**tensors)
    dev = V.check_devices(**tensors)
    batch, seqlen_q, h, d = q.shape
    h_kv = k_cache.shape[2]
    V.check_dim("k_cache", k_cache.shape[3], d, "headdim (q.shape[3])")
    for i, what in enumerate(("batch_cache / num_pages (k_cache.shape[0])",
                              "seqlen_cache / page_size (k_cache.shape[1])",
                              "nheads_kv (k_cache.shape[2])")):
        V.check_dim("v_cache", v_cache.shape[i], k_cache.shape[i], what)
    V.check_heads(h, h_kv)
    V.check_head_dims(q, v_cache)
    if k is not None:
        V.check_dim("k", k.shape[0], batch, "batch (q.shape[0])")
        V.check_dim("k", k.shape[2], h_kv, "nheads_kv (k_cache.shape[2])")
        V.check_dim("k", k.shape[3], d, "headdim (q.shape[3])")
        V.check_dim("v", v.shape[0], batch, "batch (q.shape[0])")
        V.check_dim("v", v.shape[1], k.shape[1], "seqlen_new (k.shape[1])")
        V.check_dim("v", v.shape[2], h_kv, "nheads_kv (k_cache.shape[2])")
        V.check_dim("v", v.shape[3], v_cache.shape[3], "headdim_v (v_cache.shape[3])")
    _check_rotary(rotary_cos, rotary_sin, k, d, dev)
    V.check_scalars(softmax_scale, window_size, softcap)
    V.check_alibi(alibi_slopes, batch, h, dev)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = heuristic), got {num_splits!r}")

    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: expected None with block_table (a paged cache "
                             "indexes its pages through block_table), got a tensor")
        block_table = _check_paged(k_cache, v_cache, block_table, batch, dev)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            cache_batch_idx = V.check_index_vector("cache_batch_idx", cache_batch_idx, batch, dev,
                                                     "q.shape[0]")
            vals = _host_values(cache_batch_idx)
            if vals and (min(vals) < 0 or max(vals) >= k_cache.shape[0]):
                raise ValueError(f"cache_batch_idx: expected values in [0, {k_cache.shape[0]}) "
                                 f"(k_cache.shape[0]), got {vals[:16]}")
        else:
            V.check_dim("k_cache", k_cache.shape[0], batch,
                        "batch_cache (q.shape[0], when cache_batch_idx is None)")

    s_new = k.shape[1] if k is not None else 0
    if s_new > capacity:
        where = "block_table.shape[1] * page_size" if paged else "k_cache.shape[1]"
        raise ValueError(f"k: expected seqlen_new (k.shape[1]) <= {capacity}, the cache's "
                         f"capacity ({where}), got {s_new}")
    # A paged cache's overflow is flash-attn's RuntimeError naming block_table.
    overflow = V.BlockTableCapacityError if paged else ValueError
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: expected an int or a (batch,) int32 tensor when new "
                             "k/v are appended (it says where they go), got None")
        if cache_leftpad is not None:
            raise ValueError("cache_seqlens: expected an int or a (batch,) int32 tensor with "
                             "cache_leftpad, got None")
    else:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
            raise TypeError(f"cache_seqlens: expected an int or a (batch,) int32 tensor, got "
                            f"{type(cache_seqlens).__name__}")
        if isinstance(cache_seqlens, int):
            if cache_seqlens < 0 or cache_seqlens + s_new > capacity:
                raise (overflow if cache_seqlens >= 0 else ValueError)(
                    f"cache_seqlens: expected 0 <= cache_seqlens <= {capacity - s_new} (cache "
                    f"capacity {capacity}{' of block_table' if paged else ''} - seqlen_new "
                    f"{s_new}), got {cache_seqlens}")
            cache_seqlens = torch.full((batch,), cache_seqlens, dtype=_INT32, device=dev)
        else:
            cache_seqlens = V.check_index_vector("cache_seqlens", cache_seqlens, batch, dev,
                                                   "q.shape[0]")
            vals = _host_values(cache_seqlens)
            if vals and (min(vals) < 0 or max(vals) + s_new > capacity):
                raise (overflow if min(vals) >= 0 else ValueError)(
                    f"cache_seqlens: expected values in [0, {capacity - s_new}] (cache capacity "
                    f"{capacity}{' of block_table' if paged else ''} - seqlen_new {s_new}), got "
                    f"{vals[:16]}")
            if vals is None and paged:
                _check_capacity(cache_seqlens, s_new, block_table, k_cache.shape[1])
    if cache_leftpad is not None:
        cache_leftpad = V.check_index_vector("cache_leftpad", cache_leftpad, batch, dev,
                                             "q.shape[0]")
        vals, lens = _host_values(cache_leftpad), _host_values(cache_seqlens)
        if vals and any(p < 0 or p > n for p, n in zip(vals, lens)):
            raise ValueError(f"cache_leftpad: expected 0 <= cache_leftpad[b] <= cache_seqlens[b], "
                             f"got cache_leftpad={vals[:16]}, cache_seqlens={lens[:16]}")
    if rotary_cos is not None:
        lens = _host_values(cache_seqlens)
        if lens and max(lens) + s_new > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos: expected seqlen_ro (rotary_cos.shape[0]) >= "
                             f"{max(lens) + s_new} (largest cache_seqlens + seqlen_new), "
                             f"got {rotary_cos.shape[0]}")
    return cache_seqlens, cache_batch_idx, cache_leftpad, block_table


_separate = 0  # > 0 inside separate_launches()


@contextlib.contextmanager
def separate_launches():
    """Inside the ``with`` block every ``flash_attn_with_kvcache`` call runs as separate launches
    (append, split-KV attention, combine), the path of the calls the single fused launch does
    not cover (rotary, several query-row blocks per kv head); tests and benchmarks compare."""
    global _separate
    _separate += 1
    try:
        yield
    finally:
        _separate -= 1


def _fused_plan(q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, p, num_splits):
    """The single-launch plan of a validated call (:class:`~solattn.kernels.triton.decode.
    FusedDecode`), or None where it does not apply."""
    from solattn.kernels.triton.decode import fused_covers, fused_decode_plan

    if fused_covers(q, k_cache, k, rotary_cos is not None):
        return None
    return fused_decode_plan(
        q, k_cache, v_cache, k, v, p, has_seqlens=cache_seqlens is not None,
        has_batch_idx=cache_batch_idx is not None, has_leftpad=cache_leftpad is not None,
        block_table=block_table, num_splits=num_splits, arch=device_arch(q.device),
        num_sms=num_sms(q.device))


def _kvcache_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                v: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                cache_seqlens: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                num_splits: int) -> tuple[Tensor, Tensor]:
    """Validated, normalized arguments -> ``(out, lse)``; appends k/v into the caches in place:
    one fused launch where it applies, else append (with rotary), attention and combine."""
    from solattn.kernels.triton.decode import attn_decode
    from solattn.kernels.triton.rotary import append_kv, rotary_q

    p = _params(q, k_cache, alibi_slopes, softmax_scale, causal, window_left, window_right,
                softcap)
    if not _separate:
        fused = _fused_plan(q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens,
                            cache_batch_idx, cache_leftpad, block_table, p, num_splits)
        if fused is not None:
            return fused(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, alibi_slopes)
    if k is not None and k.shape[1] > 0:
        append_kv(k, v, k_cache, v_cache, cache_seqlens, cos=rotary_cos, sin=rotary_sin,
                  interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx,
                  block_table=block_table)
    if rotary_cos is not None:
        # Queries rotate at their own positions when the mask depends on them (causal/local).
        q = rotary_q(q, rotary_cos, rotary_sin, cache_seqlens, interleaved=rotary_interleaved,
                     per_token=p.has_left or p.has_right)
    return attn_decode(
        q, k_cache, v_cache, p, cache_seqlens=cache_seqlens,
        seqlen_new=k.shape[1] if k is not None else 0, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, num_splits=num_splits,
        arch=device_arch(q.device), num_sms=num_sms(q.device))


# The op for torch.compile (it mutates the caches); eager calls run _kvcache_impl directly, as
# the op's dispatch costs more host time than a decode step's kernels (see interface.py).
_kvcache_op = torch.library.custom_op("solattn::kvcache_fwd",
                                      mutates_args=("k_cache", "v_cache"))(_kvcache_impl)


@_kvcache_op.register_kernel("cuda")
def _kvcache_cuda(*args):
    """The op on CUDA tensors: :func:`_kvcache_impl` with a workspace per call
    (:func:`solattn.kernels.triton.decode.per_call_workspaces`: compiled graphs call the op)."""
    from solattn.kernels.triton.decode import per_call_workspaces

    with per_call_workspaces():
        return _kvcache_impl(*args)


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_scale,
                  causal, window_left, window_right, softcap, rotary_interleaved, num_splits):
    b, s_q, h, _ = q.shape
    out = q.new_empty(b, s_q, h, v_cache.shape[-1])
    return out, q.new_empty(b, h, s_q, dtype=torch.float32)


# A call's tensor metadata and scalar arguments -> its single-launch plan (a FusedDecode), or
# False where the call runs the separate launches. Only CUDA calls whose index tensors are
# already contiguous int32 tensors (or None) are kept: on a GPU the checks read no values, so
# they depend on the key alone, and normalization returns the tensors themselves.
_VALIDATED = PlanCache()


def _call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
              cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
              num_splits, causal):
    """The :data:`_VALIDATED` key of a call, or None for a call that is always validated.

    What :func:`_check_kvcache` and the plan read of each tensor argument besides its values:
    exact type ``torch.Tensor`` on a CUDA device, dtype, shape, strides (index tensors are made
    contiguous) and device index, as one flat tuple (a given tensor adds those four fields, a
    None adds None: dtypes are never None, so no two calls share a key), hashed once by the
    lookup. A tensor's ``shape`` / ``stride()`` are ~0.1 us each on the H100's host, the bulk
    of the key; nested per-tensor tuples and a helper call per tensor cost as much again."""
    if V.STRICT or type(window_size) is not tuple or len(window_size) != 2 or not (
            type(window_size[0]) is int and type(window_size[1]) is int):
        return None  # (SOLATTN_CHECK: every call validates its index values)
    if not (type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
            and q.is_cuda and k_cache.is_cuda and v_cache.is_cuda):
        return None
    key = [q.dtype, q.shape, q.stride(), q.get_device(),
           k_cache.dtype, k_cache.shape, k_cache.stride(), k_cache.get_device(),
           v_cache.dtype, v_cache.shape, v_cache.stride(), v_cache.get_device(),
           softmax_scale, type(softmax_scale), window_size, softcap, type(softcap),
           num_splits, type(num_splits), bool(causal)]
    for t in (k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
              block_table, alibi_slopes):
        if t is None:
            key.append(None)
        elif type(t) is Tensor and t.is_cuda:
            key += (t.dtype, t.shape, t.stride(), t.get_device())
        else:
            return None
    return tuple(key)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            return_lse=False, sinks=None):
    """Attention of ``q`` over a KV cache, appending new tokens first (flash-attn 2.x semantics
    and positional order, through ``return_softmax_lse``; solattn's own arguments are
    keyword-only).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, headdim), fp16 or bf16. ``seqlen_q`` is 1 for decoding, a few
        for speculative decoding, anything for chunked prefill.
    k_cache, v_cache : the cache, updated in place when ``k``/``v`` are given. Either contiguous
        per sequence, ``(batch_cache, seqlen_cache, nheads_kv, headdim[_v])``, or paged (with
        ``block_table``) ``(num_pages, page_size, nheads_kv, headdim[_v])`` with any power-of-two
        ``page_size >= 1``. ``nheads % nheads_kv == 0`` (GQA/MQA). Any strides.
    k, v : optional new tokens ``(batch, seqlen_new, nheads_kv, headdim[_v])``, written into the
        cache at positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` (after rotary
        on ``k``) and attended to. Nothing else in the cache is written.
    rotary_cos, rotary_sin : optional ``(seqlen_ro, rotary_dim / 2)``; needs ``k``/``v``. ``k`` is
        rotated at its cache positions; ``q`` at ``cache_seqlens[b] + i`` when causal or local,
        else every query at ``cache_seqlens[b]``. Channels past ``rotary_dim`` are unchanged.
    cache_seqlens : int or (batch,) int32: keys already in the cache (before ``k``). None means
        every sequence fills its whole cache (``seqlen_cache`` or ``max_pages * page_size``).
    cache_batch_idx : optional (batch,) int32: sequence ``b`` uses cache row
        ``cache_batch_idx[b]`` (contiguous caches only).
    cache_leftpad : optional (batch,) int32: sequence ``b``'s keys start at cache position
        ``cache_leftpad[b]`` (positions before it are ignored); rotary positions stay the cache
        positions.
    block_table : optional (batch, max_pages_per_seq) int32: key position ``p`` of sequence ``b``
        is row ``p % page_size`` of page ``block_table[b, p // page_size]``.
    softmax_scale, causal, window_size, softcap, alibi_slopes : as :func:`solattn.flash_attn_func`.
        Masks are aligned bottom-right with ``seqlen_k = cache_seqlens[b] + seqlen_new -
        cache_leftpad[b]``::

            seqlen_q = 2, seqlen_k = 5, causal:     1 1 1 1 0
                                                    1 1 1 1 1

    rotary_interleaved : True: rotate channel pairs (0, 1), (2, 3), ... (GPT-J); False: pairs
        (i, i + rotary_dim / 2) (GPT-NeoX).
    num_splits : key-range splits per (batch, kv head) (flash-decoding); 0 picks
        :func:`solattn.configs.decode_num_splits` from the SM count, batch * heads and the cache
        length.
    return_softmax_lse, return_lse : (either) also return the log-sum-exp of each row
        (flash-attn's name, and the name solattn's other functions use).
    sinks : optional (nheads,) attention-sink logits (gpt-oss), as in
        :func:`solattn.flash_attn_func`.

    Returns
    -------
    out : (batch, seqlen_q, nheads, headdim_v), q's dtype; a row that sees no key is 0.
    lse : (batch, nheads, seqlen_q) float32 (natural log, ``-inf`` for empty rows), only with
        ``return_softmax_lse`` or ``return_lse``.

    Runs on CUDA GPUs (sm_80+; tuned on sm_90) and on the CPU under ``TRITON_INTERPRET=1``.
    Values of index tensors on a GPU are not checked (that would synchronize): out-of-range
    ``cache_seqlens``/``block_table`` entries there are undefined behaviour, as in flash-attn.
    """
    return_lse = return_lse or return_softmax_lse
    window_size, softcap = V.as_window(window_size), V.as_real("softcap", softcap)
    compiling = torch.compiler.is_compiling()
    # (no cached validation while torch.compile traces: dynamo cannot hash the key)
    key = None if compiling else _call_key(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
        num_splits, causal)
    try:
        plan = _VALIDATED.get(key) if key is not None else None
    except TypeError:  # an unhashable scalar argument (validation names it)
        key = plan = None
    if plan and not _separate:
        # A call seen before, with one launch: no validation, no parameter object (but
        # flash-attn's capacity check of a paged cache, which reads cache_seqlens).
        if block_table is not None and cache_seqlens is not None:
            _check_capacity(cache_seqlens, 0 if k is None else k.shape[1], block_table,
                            k_cache.shape[1])
        out, lse = plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, alibi_slopes, return_lse or sinks is not None)
    else:
        index = (cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
        if plan is None:
            cache_seqlens, cache_batch_idx, cache_leftpad, block_table = _check_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, softmax_scale, window_size,
                softcap, alibi_slopes, num_splits)
        scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
        wl, wr = int(window_size[0]), int(window_size[1])
        if key is not None and plan is None and all(
                a is b for a, b in zip((cache_seqlens, cache_batch_idx, cache_leftpad,
                                        block_table), index)):
            p = _params(q, k_cache, alibi_slopes, scale, bool(causal), wl, wr, float(softcap))
            _VALIDATED.put(key, _fused_plan(
                q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, p, int(num_splits)) or False)
        op = _kvcache_op if compiling else _kvcache_impl
        out, lse = op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                      cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale,
                      bool(causal), wl, wr, float(softcap), bool(rotary_interleaved),
                      int(num_splits))
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, layout="bshd")
    return (out, lse) if return_lse else out


def flash_attn_combine(out_partial, lse_partial, out_dtype=None):
    """Merge attention computed over disjoint key sets into attention over their union.

    Parameters
    ----------
    out_partial : (num_splits, *rows, headdim), float32 / fp16 / bf16: each part's normalized
        output (e.g. ``rows = (batch, seqlen_q, nheads)``).
    lse_partial : (num_splits, *rows) float32: each part's natural-log log-sum-exp; ``-inf`` marks
        a part that saw no key (its output is then ignored, even NaN).
    out_dtype : dtype of the merged output; default ``out_partial.dtype``.

    Returns
    -------
    out : (*rows, headdim) in ``out_dtype``: ``sum_s exp(lse_s - lse) * out_s``.
    lse : (*rows) float32: ``logsumexp_s lse_s`` (``-inf`` where every part is empty).

    The layout matches FlashAttention-3's ``flash_attn_combine`` (lse without the head dim).
    """
    from solattn.kernels.triton.combine import combine_into

    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise TypeError("out_partial/lse_partial: expected torch.Tensors, got "
                        f"{type(out_partial).__name__}/{type(lse_partial).__name__}")
    if out_partial.dim() < 2:
        raise ValueError(f"out_partial: expected shape (num_splits, *rows, headdim), "
                         f"got {tuple(out_partial.shape)}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial: expected shape {tuple(out_partial.shape[:-1])} "
                         f"(out_partial.shape[:-1]), got {tuple(lse_partial.shape)}")
    if lse_partial.dtype != torch.float32:
        raise TypeError(f"lse_partial: expected dtype torch.float32, got {lse_partial.dtype}")
    if out_partial.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_partial: expected dtype float32, float16 or bfloat16, "
                        f"got {out_partial.dtype}")
    out_dtype = out_dtype or out_partial.dtype
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype: expected float32, float16 or bfloat16, got {out_dtype}")
    V.check_devices(out_partial=out_partial, lse_partial=lse_partial)
    if out_partial.shape[0] < 1:
        raise ValueError(f"out_partial: expected num_splits (shape[0]) >= 1, "
                         f"got {out_partial.shape[0]}")
    rows, d = tuple(out_partial.shape[1:-1]), out_partial.shape[-1]
    out = torch.empty(*rows, d, dtype=out_dtype, device=out_partial.device)
    lse = torch.empty(rows, dtype=torch.float32, device=out_partial.device)
    # The kernel walks rows as (A, B, C): pad with leading 1s, or flatten the leading dims.
    n = len(rows)
    if n <= 3:
        shape3 = (1,) * (3 - n) + rows
    else:
        shape3 = (math.prod(rows[:-2]), *rows[-2:])
    s = out_partial.shape[0]
    combine_into(out_partial.reshape(s, *shape3, d), lse_partial.reshape(s, *shape3),
                 out.view(*shape3, d), lse.view(shape3))
    return out, lse
