"""Host-side checks of user input, run before any kernel launch.

Each helper raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape or
value) whose message names the argument, what was expected and what was received. Never
``assert`` on user input. Shared by the forward, backward and decode entry points.
"""

from __future__ import annotations

import numbers
import operator
import os

import torch

from solattn.device import interpreting

# SOLATTN_CHECK=1 (read at import; tests set ``STRICT`` itself): the values of every index
# tensor (cu_seqlens_q/k, seqused_k, cache_seqlens, cache_batch_idx, cache_leftpad,
# block_table, a BlockMask's indices) are read on the host and checked before each launch, also
# on a GPU, where reading them synchronizes. Off by default: the kernels bound every index they
# read against the tensors' extents, so invalid values give wrong but contained results there.
STRICT = os.environ.get("SOLATTN_CHECK", "0") not in ("", "0")


class BlockTableCapacityError(ValueError, RuntimeError):
    """A KV-cache call whose keys outgrow what ``block_table`` addresses. flash-attn raises
    ``RuntimeError`` for it; the class is also a ``ValueError``, as solattn's other value
    checks are."""

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn   # flash_attn_func's FP8 forward (Hopper only)
MAX_HEAD_DIM = 256


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-D tensor of shape {layout}, got shape {tuple(t.shape)}"
        )


def check_attn_mask(attn_mask, q: torch.Tensor, shape: tuple) -> None:
    """SDPA's rules for ``attn_mask`` against the problem ``shape`` = ``(B, H, L, S)``: a bool
    tensor or one of q's dtype, on q's device, at most 4-D, each dim 1 or the problem's."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, q.dtype):
        raise TypeError(f"attn_mask: expected dtype torch.bool or q's dtype {q.dtype}, got "
                        f"{attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask: expected device {q.device} (q's), got {attn_mask.device}")
    if attn_mask.dim() > 4 or any(
            m not in (1, n) for m, n in zip(attn_mask.shape[::-1], shape[::-1])):
        raise ValueError(f"attn_mask: expected a shape broadcastable to (batch, heads, seqlen_q, "
                         f"seqlen_k) = {tuple(shape)}, got {tuple(attn_mask.shape)}")


def check_dtypes(allow_fp8: bool = False, **tensors: torch.Tensor) -> torch.dtype:
    """All tensors fp16, or all bf16 (or, with ``allow_fp8``, all float8_e4m3fn). Returns the
    common dtype."""
    names = list(tensors)
    first = tensors[names[0]].dtype
    allowed = SUPPORTED_DTYPES + ((FP8_DTYPE,) if allow_fp8 else ())
    for name, t in tensors.items():
        if t.dtype not in allowed:
            if t.dtype == FP8_DTYPE:
                raise TypeError(f"{name}: float8_e4m3fn inputs are supported by the forwards of "
                                "flash_attn_func and flash_attn_varlen_func only (Hopper GPUs); "
                                "this entry point expects "
                                f"torch.float16 or torch.bfloat16, got {t.dtype}")
            expected = "torch.float16, torch.bfloat16 or torch.float8_e4m3fn" if allow_fp8 \
                else "torch.float16 or torch.bfloat16"
            raise TypeError(f"{name}: expected dtype {expected}, got {t.dtype}")
        if t.dtype != first:
            raise TypeError(
                f"{name}: expected dtype {first} (the dtype of {names[0]}), got {t.dtype}"
            )
    if first == torch.bfloat16 and interpreting():
        from solattn import interpreter

        if not interpreter.BF16_OK:
            raise NotImplementedError(
                f"{names[0]}: torch.bfloat16 under TRITON_INTERPRET=1 is not supported with this "
                "Triton (its interpreter computes bf16 wrongly, and solattn could not hook it "
                "to run bf16 in float32): use torch.float16 on the CPU, or a GPU")
    return first


def check_devices(**tensors) -> torch.device:
    """All given tensors on one device; CPU only under Triton's interpreter."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    dev = items[0][1].device
    for name, t in items:
        if t.device != dev:
            raise ValueError(
                f"{name}: expected device {dev} (the device of {items[0][0]}), got {t.device}"
            )
    if dev.type != "cuda" and not interpreting():
        raise ValueError(
            f"{items[0][0]}: expected a CUDA tensor, got device {dev}. solattn's "
            "kernels run on NVIDIA GPUs; to run them on the CPU (slowly, for testing) "
            "set TRITON_INTERPRET=1 before importing solattn."
        )
    return dev


def check_dim(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: expected {what} = {expected}, got {actual}")


def check_head_dims(q: torch.Tensor, v: torch.Tensor) -> None:
    for name, d in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if d > MAX_HEAD_DIM or d < 1:
            raise ValueError(f"{name}: expected head dim in [1, {MAX_HEAD_DIM}], got {d}")


def check_heads(n_heads: int, n_heads_kv: int) -> None:
    if n_heads_kv < 1 or n_heads % n_heads_kv != 0:
        raise ValueError(
            f"k: expected nheads_kv to divide nheads_q = {n_heads} (GQA/MQA), "
            f"got nheads_kv = {n_heads_kv}"
        )


def as_window(window_size) -> tuple[int, int]:
    """flash-attn's ``window_size`` as ``(left, right)`` Python ints: any pair of integers -- a
    tuple or list of ints (numpy ints, 0-d integer tensors), or a 2-element integer tensor (read
    on the host, as flash-attn's conversion to C++ ints does). ``TypeError`` otherwise (flash-attn
    raises ``TypeError`` for non-integers too)."""
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int \
            and type(window_size[1]) is int:
        return window_size
    what = f"{type(window_size).__name__} {window_size!r}"
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.dtype.is_floating_point \
                or window_size.dtype.is_complex:
            raise TypeError(f"window_size: expected a pair of ints (left, right), got a tensor of "
                            f"shape {tuple(window_size.shape)} and dtype {window_size.dtype}")
        left, right = window_size.reshape(2).tolist()
        return int(left), int(right)
    try:
        items = list(window_size)
    except TypeError:
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {what}") \
            from None
    if len(items) != 2:
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {what}")
    try:
        return operator.index(items[0]), operator.index(items[1])
    except TypeError:
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {what}") \
            from None


def as_real(name: str, x, what: str = "a float"):
    """A real scalar argument (``softmax_scale``, ``softcap``) as a Python float: ints, floats,
    numpy scalars and 0-d real tensors are accepted (flash-attn converts with ``float()``);
    anything else raises ``TypeError`` naming the argument."""
    if type(x) is float:
        return x
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() == 0 \
            and not x.dtype.is_complex and x.dtype != torch.bool:
        return float(x.item())
    raise TypeError(f"{name}: expected {what}, got {type(x).__name__} {x!r}")


def check_scalars(softmax_scale, window_size, softcap) -> tuple[int, int]:
    if softmax_scale is not None:
        as_real("softmax_scale", softmax_scale, "a float or None")
    left, right = as_window(window_size)
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size: expected each of (left, right) >= -1 (-1 = unbounded), "
            f"got {(left, right)}"
        )
    if as_real("softcap", softcap) < 0:
        raise ValueError(f"softcap: expected softcap >= 0 (0 = off), got {softcap}")
    return left, right


def check_dropout(dropout_p) -> None:
    """``dropout_p``: a float in [0, 1) (1 would drop every probability and scale by 1/0)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected 0 <= dropout_p < 1, got {dropout_p}")


def check_alibi(alibi_slopes, batch: int, n_heads: int, device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes: expected a torch.Tensor or None, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected dtype torch.float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((n_heads,), (batch, n_heads)):
        raise ValueError(
            f"alibi_slopes: expected shape ({n_heads},) or ({batch}, {n_heads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes: expected device {device}, got {alibi_slopes.device}")
    if alibi_slopes.requires_grad:
        raise ValueError(
            "alibi_slopes: gradients with respect to ALiBi slopes are not supported; "
            "pass alibi_slopes.detach()"
        )


def values_unreadable(t: torch.Tensor) -> bool:
    """Whether the values of index tensor ``t`` are left unchecked: on a GPU unless
    :data:`STRICT` (``SOLATTN_CHECK=1``) -- reading them is a device->host copy that
    synchronizes every call; flash-attn does not check them either, and the kernels keep every
    address they form from them inside the tensors -- and always while tracing. CPU tensors
    (the interpreter) are checked."""
    return (t.is_cuda and not STRICT) or torch.compiler.is_compiling()


def check_max_seqlen(name: str, max_seqlen, cu: torch.Tensor | None) -> None:
    """``max_seqlen`` must be an int >= every length in ``cu`` (else rows would be dropped);
    ``cu`` None (paged keys counted by ``seqused_k`` alone): only the int is checked."""
    if isinstance(max_seqlen, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:  # ints, numpy ints, 0-d integer tensors (flash-attn converts to a C++ int)
        max_seqlen = operator.index(max_seqlen)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(max_seqlen).__name__}") from None
    if max_seqlen < 0:
        raise ValueError(f"{name}: expected >= 0, got {max_seqlen}")
    if cu is not None and cu.numel() > 1 and not values_unreadable(cu):
        longest = int((cu[1:] - cu[:-1]).max().item())
        if longest > max_seqlen:
            raise ValueError(
                f"{name}: expected >= the longest sequence ({longest}), got {max_seqlen}"
            )


def check_cu_seqlens(name: str, cu: torch.Tensor, device, total: int | None = None) -> int:
    """int32, 1-D; its values (non-decreasing, starting at 0, at most ``total``) are checked
    where :func:`values_unreadable` allows (CPU tensors).

    Returns the batch size ``len(cu) - 1``.
    """
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(
            f"{name}: expected a 1-D tensor of length batch + 1 >= 1, got shape {tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device}, got {cu.device}")
    if values_unreadable(cu):
        return cu.numel() - 1
    vals = cu.cpu()
    if vals[0].item() != 0:
        raise ValueError(f"{name}: expected {name}[0] = 0, got {vals[0].item()}")
    if cu.numel() > 1 and bool((vals[1:] < vals[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing values, got {vals.tolist()[:16]}")
    if total is not None and vals[-1].item() > total:
        raise ValueError(
            f"{name}: expected {name}[-1] <= {total} (total tokens), got {vals[-1].item()}"
        )
    return cu.numel() - 1


def check_index_vector(name: str, t, batch: int, device, batch_is: str) -> torch.Tensor:
    """A per-sequence ``(batch,)`` int32 tensor on ``device`` (``seqused_k``, ``cache_seqlens``,
    ``cache_batch_idx``, ``cache_leftpad``), returned contiguous: the kernels index it with
    stride 1. ``batch_is`` says where ``batch`` comes from, for the error message."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of dtype torch.int32 or None, "
                        f"got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},) (batch = {batch_is}), "
                         f"got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    return t.contiguous()


def check_seqused_k(seqused_k, batch: int, device) -> torch.Tensor:
    """``seqused_k``: :func:`check_index_vector`; its values are checked by
    :func:`check_key_counts`."""
    return check_index_vector("seqused_k", seqused_k, batch, device, "len(cu_seqlens_q) - 1")


def check_block_table(block_table, batch: int, device) -> torch.Tensor:
    """``block_table``: (batch, max_pages_per_seq) int32 on ``device``; returned with a unit
    last stride (a copy only if it had another). Its values: :func:`check_key_counts`."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table: expected a torch.Tensor or None, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected shape ({batch}, max_pages_per_seq) (batch = "
                         f"len(cu_seqlens_q) - 1), got {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table: expected device {device}, got {block_table.device}")
    return block_table if block_table.stride(1) == 1 else block_table.contiguous()


def check_key_counts(cu_seqlens_k, seqused_k, block_table, *, num_pages: int,
                     page_size: int) -> None:
    """The values of the key counts and pages of a varlen call (CPU tensors only, see
    :func:`values_unreadable`): each sequence's key count (``seqused_k[b]``, else its
    ``cu_seqlens_k`` length) is >= 0 and fits its keys -- its ``cu_seqlens_k`` span without a
    block table, ``max_pages_per_seq * page_size`` with one -- and the pages those keys occupy
    are in ``[0, num_pages)``. Block-table entries past a sequence's keys are never read and
    may hold anything (padding)."""
    index = [t for t in (cu_seqlens_k, seqused_k, block_table) if t is not None]
    if any(values_unreadable(t) for t in index):
        return
    spans = None
    if cu_seqlens_k is not None:
        cu = cu_seqlens_k.tolist()
        spans = [b - a for a, b in zip(cu[:-1], cu[1:])]
    counts = seqused_k.tolist() if seqused_k is not None else spans
    if seqused_k is not None and any(n < 0 for n in counts):
        raise ValueError(f"seqused_k: expected values >= 0, got {counts[:16]}")
    if block_table is None:
        if any(n > s for n, s in zip(counts, spans)):
            raise ValueError(f"seqused_k: expected seqused_k[b] <= cu_seqlens_k[b + 1] - "
                             f"cu_seqlens_k[b] (the keys of sequence b), got seqused_k = "
                             f"{counts[:16]}, cu_seqlens_k lengths = {spans[:16]}")
        return
    capacity = block_table.shape[1] * page_size
    name = "seqused_k" if seqused_k is not None else "cu_seqlens_k"
    if any(n > capacity for n in counts):
        raise ValueError(f"{name}: expected key counts <= {capacity} (block_table.shape[1] * "
                         f"page_size), got {counts[:16]}")
    for b, (row, n) in enumerate(zip(block_table.tolist(), counts)):
        used = row[: -(-n // page_size)]
        if used and (min(used) < 0 or max(used) >= num_pages):
            raise ValueError(f"block_table: expected the pages of sequence {b}'s {n} keys "
                             f"(block_table[{b}, :{len(used)}]) in [0, {num_pages}) (k.shape[0] "
                             f"pages), got {used[:16]}")


# ---------------------------------------------------------------------------------------------
# FP8 (float8_e4m3fn) inputs: flash_attn_func's forward on sm_90 only
# ---------------------------------------------------------------------------------------------

def check_fp8_device(name: str, device: torch.device) -> None:
    """FP8 runs on a CUDA GPU of compute capability 9.0 only: raise ``NotImplementedError``
    for the CPU, Triton's interpreter, or another GPU (naming its capability)."""
    if interpreting() or device.type != "cuda":
        where = "Triton's interpreter (TRITON_INTERPRET=1)" if interpreting() else str(device)
        raise NotImplementedError(
            f"{name}: float8_e4m3fn attention runs on a CUDA GPU of compute capability 9.0 "
            f"(sm_90, Hopper) only, not on {where}")
    check_fp8_arch(device, *torch.cuda.get_device_capability(device))


def check_fp8_arch(device, major: int, minor: int) -> None:
    """``NotImplementedError`` unless ``(major, minor)`` (``device``'s compute capability) is
    9.0: the FP8 kernel is written for sm_90's 8-bit wgmma."""
    if (major, minor) != (9, 0):
        raise NotImplementedError(
            f"float8_e4m3fn attention needs compute capability 9.0 (sm_90, Hopper); {device} "
            f"has compute capability {major}.{minor} (sm_{major}{minor})")


def check_descale(name: str, t, batch: int, n_heads_kv: int, device) -> torch.Tensor | None:
    """A descale argument of the FP8 forward: None (1), or float32 ``(batch, nheads_kv)`` on
    ``device``. Returns it contiguous (the kernel indexes ``b * nheads_kv + h_kv``)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    if tuple(t.shape) != (batch, n_heads_kv):
        raise ValueError(f"{name}: expected shape ({batch}, {n_heads_kv}) (batch, nheads_kv), "
                         f"got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")
    return t.contiguous()
