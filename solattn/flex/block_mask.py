"""BlockMasks without torch.compile: block classification on the device, and the block lists the
flex kernels walk.

:func:`create_block_mask` evaluates a ``mask_mod`` on every element of every
``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)`` block and classifies the block as empty, partial or full
(every element True: the kernels skip ``mask_mod`` there). It never materializes the
``Q_LEN x KV_LEN`` mask:

* on a GPU (and for ``@triton.jit`` mask_mods) one Triton program per block evaluates the
  generated device function of the mask_mod (:mod:`solattn.flex.codegen`) -- the same code the
  attention kernels run -- and counts its True elements;
* on the CPU, vectorized PyTorch evaluates the Python ``mask_mod`` on broadcast index tensors, a
  chunk of query blocks at a time (bounded memory; the loop is over chunks, not blocks).

Like torch's, the result is a ``torch.nn.attention.flex_attention.BlockMask`` (the class is
re-exported, so both libraries accept each other's masks): kv-major lists for the forward
(``kv_num_blocks`` / ``kv_indices``, ``full_kv_*``), q-major for the backward (``q_num_blocks`` /
``q_indices``, ``full_q_*``). Positions past the sequence count as masked, so a ragged edge block
is never full.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn.attention.flex_attention import (  # noqa: F401 - re-exported API
    BlockMask,
    and_masks,
    create_mask,
    noop_mask,
    or_masks,
)

_EMPTY, _PARTIAL, _FULL = 0, 1, 2
_TORCH_CHUNK_ELEMENTS = 1 << 25  # mask elements evaluated per vectorized step on the CPU


def _block_sizes(BLOCK_SIZE) -> tuple[int, int]:
    bq, bkv = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, v in (("BLOCK_SIZE (query)", bq), ("BLOCK_SIZE (key)", bkv)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two >= 16 (the kernels' tiles divide "
                             f"it), got {v!r}")
    return bq, bkv


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks=True, compute_dq_write_order=False, dq_kv_order=True):
    """Block-sparse mask of ``mask_mod``, computed on ``device`` (torch's signature).

    Parameters
    ----------
    mask_mod : ``(b, h, q_idx, kv_idx) -> bool`` in plain PyTorch (indices are int32 scalar
        tensors; captured tensors may be indexed, e.g. ``doc_ids[q_idx] == doc_ids[kv_idx]``), or
        a ``@triton.jit`` function ``(b, h, q_idx, kv_idx, ARGS)`` evaluated on tiles.
    B, H : batch and query heads; ``None`` broadcasts (size 1), as in torch.
    Q_LEN, KV_LEN : sequence lengths.
    device : default: the current accelerator, else CPU (as torch).
    BLOCK_SIZE : int or (q, kv); powers of two >= 16.
    _compile : ignored (torch's deprecated flag; nothing here needs torch.compile).
    separate_full_blocks : False lists every non-empty block as partial (mask_mod everywhere).
    compute_dq_write_order : only False (torch's deterministic FLASH-backend metadata).

    Returns
    -------
    torch's ``BlockMask``, with ``mask_mod`` kept for the kernels' partial blocks.
    """
    if compute_dq_write_order:
        raise NotImplementedError("create_block_mask: compute_dq_write_order=True is metadata "
                                  "for torch's FLASH backend; solattn does not use it")
    if not callable(mask_mod):
        raise TypeError(f"mask_mod: expected a callable (b, h, q_idx, kv_idx) -> bool, got "
                        f"{type(mask_mod).__name__}")
    bq, bkv = _block_sizes(BLOCK_SIZE)
    B = 1 if B is None else int(B)
    H = 1 if H is None else int(H)
    if device is None:
        device = torch.accelerator.current_accelerator() or "cpu"
    device = torch.device(device)
    classes = block_classes(mask_mod, B, H, int(Q_LEN), int(KV_LEN), device, bq, bkv)
    if not separate_full_blocks:
        classes = torch.where(classes == _FULL, _PARTIAL, classes)
    return _from_classes(classes, mask_mod, (int(Q_LEN), int(KV_LEN)), (bq, bkv))


def block_classes(mask_mod, B, H, Q_LEN, KV_LEN, device, bq, bkv, impl=None) -> torch.Tensor:
    """``(B, H, cdiv(Q_LEN, bq), cdiv(KV_LEN, bkv))`` int8: 0 empty, 1 partial, 2 full.

    ``impl``: ``"triton"`` (default on CUDA and for ``@triton.jit`` mods) or ``"torch"``
    (default on the CPU)."""
    from solattn.flex.trace import _is_jit

    if impl is None:
        impl = "triton" if device.type == "cuda" or _is_jit(mask_mod) else "torch"
    if impl == "torch":
        return _classes_torch(mask_mod, B, H, Q_LEN, KV_LEN, device, bq, bkv)
    return _classes_triton(mask_mod, B, H, Q_LEN, KV_LEN, device, bq, bkv)


def _classes_torch(mask_mod, B, H, Q_LEN, KV_LEN, device, bq, bkv):
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    out = torch.empty(B, H, n_q, n_kv, dtype=torch.int8, device=device)
    b = torch.arange(B, dtype=torch.int32, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, dtype=torch.int32, device=device).view(1, H, 1, 1)
    kv = torch.arange(KV_LEN, dtype=torch.int32, device=device).view(1, 1, 1, KV_LEN)
    step = max(1, _TORCH_CHUNK_ELEMENTS // (B * H * n_kv * bkv * bq))  # query blocks a chunk
    for i0 in range(0, n_q, step):
        i1 = min(n_q, i0 + step)
        rows = min(i1 * bq, Q_LEN) - i0 * bq
        q = torch.arange(i0 * bq, i0 * bq + rows, dtype=torch.int32, device=device)
        keep = mask_mod(b, h, q.view(1, 1, rows, 1), kv)
        if not isinstance(keep, torch.Tensor):
            raise TypeError(f"mask_mod must return a bool tensor, got {type(keep).__name__}")
        # Keep the mask's own batch/head extent (1 where it does not depend on them): the
        # per-block reduction runs once for all the (b, h) it broadcasts over.
        keep = keep.to(torch.bool).view(torch.uint8)
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        keep = keep.expand(keep.shape[0], keep.shape[1], rows, KV_LEN)
        pad_q, pad_kv = (i1 - i0) * bq - rows, n_kv * bkv - KV_LEN
        if pad_q or pad_kv:  # padding past the sequences is masked: ragged blocks are partial
            keep = torch.nn.functional.pad(keep, (0, pad_kv, 0, pad_q))
        blocks = keep.reshape(keep.shape[0], keep.shape[1], i1 - i0, bq, n_kv, bkv)
        # max / min over uint8: ~10x faster on the CPU than counting
        any_ = blocks.amax(-1).amax(3)
        all_ = blocks.amin(-1).amin(3)
        out[:, :, i0:i1] = (any_.to(torch.int8) + all_.to(torch.int8)).expand(B, H, -1, -1)
    return out


@triton.jit
def _classify_kernel(OUT, ARGS, stride_ob, stride_oh, stride_om, Q_LEN, KV_LEN, H,
                     MASK_MOD: tl.constexpr, SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
                     CHUNK_M: tl.constexpr):
    """One program per (query block, key block, batch x head): count the block's True elements
    of the generated mask_mod (padding past the sequences counts as False)."""
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    b = tl.program_id(2) // H
    h = tl.program_id(2) % H
    cols = nb * SPARSE_N + tl.arange(0, SPARSE_N)
    kv_idx = tl.minimum(cols, KV_LEN - 1)[None, :]
    count = 0
    for m0 in tl.static_range(0, SPARSE_M, CHUNK_M):
        rows = mb * SPARSE_M + m0 + tl.arange(0, CHUNK_M)
        inside = (rows[:, None] < Q_LEN) & (cols[None, :] < KV_LEN)
        keep = MASK_MOD(b, h, tl.minimum(rows, Q_LEN - 1)[:, None], kv_idx, ARGS) & inside
        count += tl.sum(tl.sum(keep.to(tl.int32), 1), 0)
    state = tl.where(count == 0, 0, tl.where(count == SPARSE_M * SPARSE_N, 2, 1))
    tl.store(OUT + b * stride_ob + h * stride_oh + mb * stride_om + nb, state.to(tl.int8))


def _classes_triton(mask_mod, B, H, Q_LEN, KV_LEN, device, bq, bkv):
    from solattn.flex.registry import mask_fns_and_args

    fn, args = mask_fns_and_args(mask_mod, device)
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    out = torch.empty(B, H, n_q, n_kv, dtype=torch.int8, device=device)
    if fn is None:  # noop mask: every in-bounds element is kept
        full_q = torch.arange(n_q, device=device) < Q_LEN // bq
        full_kv = torch.arange(n_kv, device=device) < KV_LEN // bkv
        out[:] = torch.where(full_q[:, None] & full_kv[None, :], _FULL, _PARTIAL)
        return out
    chunk = max(1, min(bq, 4096 // bkv))
    _classify_kernel[(n_q, n_kv, B * H)](
        out, args, out.stride(0), out.stride(1), out.stride(2), Q_LEN, KV_LEN, H,
        MASK_MOD=fn, SPARSE_M=bq, SPARSE_N=bkv, CHUNK_M=chunk, num_warps=4)
    return out


def _ordered(classes: torch.Tensor, which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num (..., rows) int32, indices (..., rows, cols) int32)``: per row the columns of
    class ``which`` in ascending order, then the others (torch's layout)."""
    hit = (classes == which).to(torch.int32)
    num = hit.sum(-1, dtype=torch.int32)
    idx = torch.argsort(hit, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _from_classes(classes, mask_mod, seq_lengths, block_size) -> BlockMask:
    kv_num, kv_idx = _ordered(classes, _PARTIAL)
    full_kv_num, full_kv_idx = _ordered(classes, _FULL)
    t = classes.transpose(-2, -1)
    q_num, q_idx = _ordered(t, _PARTIAL)
    full_q_num, full_q_idx = _ordered(t, _FULL)
    return BlockMask(seq_lengths, kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx,
                     full_q_num, full_q_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod)


# ---------------------------------------------------------------------------------------------
# BlockMask -> the kernels' lists
# ---------------------------------------------------------------------------------------------

def _dense(num, idx, n_cols, value, out):
    """Scatter one ordered list into the dense class map ``out`` (..., rows, n_cols + 1)."""
    pos = torch.arange(idx.shape[-1], device=idx.device)
    # (indices outside [0, n_cols) land in the spare column n_cols: never a scatter out of range)
    cols = torch.where((pos < num[..., None]) & (idx >= 0) & (idx < n_cols), idx.long(), n_cols)
    out.scatter_(-1, cols, value)


def list_args(num, idx) -> tuple:
    """One ``(num, idx)`` list pair as the flex kernels take it (a tuple argument): the tensors
    and their strides (the kernels step through a row's indices with stride 1)."""
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    return (num, idx, *num.stride(), *idx.stride()[:3], idx.shape[-1])


class KernelLists(tuple):
    """The 8 list tensors of :func:`kernel_lists` (a tuple of them), and ``args``: each
    ``(num, idx)`` pair's :func:`list_args`, built once. A call that reuses the lists passes the
    same argument tuples, whose specialization a cached launch then need not check again
    (:class:`solattn.launch.Launch`)."""

    def __new__(cls, lists):
        self = super().__new__(cls, lists)
        self.args = tuple(list_args(self[i], self[i + 1]) for i in range(0, 8, 2))
        self._mean_kv_blocks = None
        return self

    def mean_kv_blocks(self, read: bool = True) -> float | None:
        """Key blocks listed (partial and full) per query block, averaged over the (B, H)
        rows: read to the host once per lists (one synchronization, at the first call that
        asks with ``read``; without it, None until then)."""
        if self._mean_kv_blocks is None and read:
            self._mean_kv_blocks = float((self[0] + self[2]).float().mean())
        return self._mean_kv_blocks


def kernel_lists(block_mask: BlockMask, B: int, H: int, Q_LEN: int, KV_LEN: int,
                 cache: bool = True):
    """The 8 list tensors the flex kernels read, ``(kv_num, kv_idx, full_kv_num, full_kv_idx,
    q_num, q_idx, full_q_num, full_q_idx)``, each broadcast to ``(B, H, ...)`` (stride 0 where the
    mask broadcasts) with a unit last stride.

    Kept on the BlockMask for the next call of the same shape (``cache``; not under
    torch.compile, whose graph rebuilds them): the key holds each list tensor's identity and
    version counter, so a list replaced or modified in place is rebuilt.

    Full blocks must lie inside both sequences (the kernels load them without bounds checks):
    when a length is not a multiple of the block size, a full block in the last row or column
    (possible in hand-made masks; create_block_mask never makes one) is listed as partial, and
    missing q-major or full lists are rebuilt.
    """
    lists = [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
             block_mask.full_kv_indices, block_mask.q_num_blocks, block_mask.q_indices,
             block_mask.full_q_num_blocks, block_mask.full_q_indices]
    from solattn import validation

    if validation.STRICT and not torch.compiler.is_compiling():
        check_list_values(block_mask, lists, Q_LEN, KV_LEN)
    if not cache:
        return _kernel_lists(block_mask, lists, B, H, Q_LEN, KV_LEN)
    key = (B, H, Q_LEN, KV_LEN, tuple(block_mask.BLOCK_SIZE),
           tuple(None if t is None else (id(t), t._version) for t in lists))
    cached = getattr(block_mask, "_solattn_kernel_lists", None)
    if cached is None or cached[0] != key:
        cached = (key, KernelLists(_kernel_lists(block_mask, lists, B, H, Q_LEN, KV_LEN)))
        block_mask._solattn_kernel_lists = cached
    return cached[1]


_LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def check_list_values(block_mask, lists, Q_LEN: int, KV_LEN: int) -> None:
    """``SOLATTN_CHECK=1``: every count in ``[0, indices.shape[-1]]`` and every index in
    ``[0, blocks)`` (read on the host: synchronizes), else ``ValueError`` naming the list. The
    kernels clamp them either way (:func:`_kernel_lists`, ``common.sparse_blocks``)."""
    bq, bkv = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    for i in range(0, 8, 2):
        num, idx = lists[i], lists[i + 1]
        if num is None or idx is None:
            continue
        n = n_kv if i < 4 else n_q
        if bool(((num < 0) | (num > idx.shape[-1])).any()):
            raise ValueError(f"block_mask.{_LIST_NAMES[i]}: expected values in [0, "
                             f"{idx.shape[-1]}] ({_LIST_NAMES[i + 1]}.shape[-1]), got values in "
                             f"[{int(num.min())}, {int(num.max())}]")
        pos = torch.arange(idx.shape[-1], device=idx.device)
        used = pos < num[..., None]
        bad = used & ((idx < 0) | (idx >= n))
        if bool(bad.any()):
            raise ValueError(f"block_mask.{_LIST_NAMES[i + 1]}: expected the listed block indices "
                             f"in [0, {n}) (blocks of {bq if i >= 4 else bkv} "
                             f"{'queries' if i >= 4 else 'keys'}), got {idx[bad][:8].tolist()}")


def _kernel_lists(block_mask, lists, B, H, Q_LEN, KV_LEN):
    bq, bkv = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    ragged = Q_LEN % bq != 0 or KV_LEN % bkv != 0
    if ragged or any(t is None for t in lists[4:6]):
        dev = lists[0].device
        num = lists[0][..., :n_q]
        classes = torch.zeros(*num.shape, n_kv + 1, dtype=torch.int8, device=dev)
        _dense(num, lists[1][..., :n_q, :], n_kv, _PARTIAL, classes)
        if lists[2] is not None:
            _dense(lists[2][..., :n_q], lists[3][..., :n_q, :], n_kv, _FULL, classes)
        classes = classes[..., :n_kv]
        if ragged:
            edge = torch.zeros(n_q, n_kv, dtype=torch.bool, device=dev)
            if Q_LEN % bq:
                edge[-1, :] = True
            if KV_LEN % bkv:
                edge[:, -1] = True
            classes = torch.where(edge & (classes == _FULL), _PARTIAL, classes).to(torch.int8)
        bm = _from_classes(classes, None, (Q_LEN, KV_LEN), (bq, bkv))
        lists = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                 bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]
    out = []
    for i, t in enumerate(lists):
        if t is None:  # no full blocks listed: an empty list of the partial list's shape
            t = torch.zeros_like(lists[i - 2]) if i % 2 == 0 else lists[i - 2]
        t = t.to(torch.int32)
        if i % 2:  # indices: clamped to real blocks, once per lists (every kernel reads them)
            t = t.clamp(0, max((n_kv if i < 4 else n_q) - 1, 0))
        if t.dim() == (3 if i % 2 == 0 else 4) - 1:  # (H, ...) without a batch dim
            t = t.unsqueeze(0)
        for dim, (have, want, name) in enumerate(((t.shape[0], B, "batch"),
                                                  (t.shape[1], H, "heads"))):
            if have not in (1, want):
                raise ValueError(f"block_mask: {name} dimension is {have}, expected 1 "
                                 f"(broadcast) or {want} (the query's)")
        t = t.expand(B, H, *t.shape[2:])
        if t.stride(-1) != 1:
            t = t.contiguous()
        out.append(t)
    return out


_DENSE: dict = {}


def dense_lists(B: int, H: int, Q_LEN: int, KV_LEN: int, block: tuple[int, int], device,
                cache: bool = True):
    """Kernel lists of "no mask": every block full, the ragged edge blocks partial (kept for
    the next call of the same shape unless ``cache`` is False, as under torch.compile, whose
    graph rebuilds them)."""
    key = (B, H, Q_LEN, KV_LEN, block, str(device))
    if cache and key in _DENSE:
        return _DENSE[key]
    if cache and len(_DENSE) > 64:
        _DENSE.clear()
    lists = _dense_lists(B, H, Q_LEN, KV_LEN, block, device)
    if cache:
        lists = _DENSE[key] = KernelLists(lists)
    return lists


def _dense_lists(B, H, Q_LEN, KV_LEN, block, device):
    bq, bkv = block
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    edge_q = torch.arange(n_q, device=device) >= Q_LEN // bq
    edge_kv = torch.arange(n_kv, device=device) >= KV_LEN // bkv
    classes = torch.where(edge_q[:, None] | edge_kv[None, :], _PARTIAL, _FULL).to(torch.int8)
    bm = _from_classes(classes[None, None], None, (Q_LEN, KV_LEN), block)
    return [t.expand(B, H, *t.shape[2:]) for t in (
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
        bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)]
