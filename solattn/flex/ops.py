"""flex_attention on solattn's kernels: mod registry -> custom ops -> autograd -> API.

The forward runs on the Hopper (Gluon) flex kernel on sm_90 where it applies, else on the portable
Triton kernel (:data:`solattn.dispatch.FLEX_FORWARD`, :mod:`solattn.kernels.hopper.flex_forward`);
the backward likewise (:data:`solattn.dispatch.FLEX_BACKWARD`,
:mod:`solattn.kernels.hopper.flex_backward`; dropout, and mods whose code does not fit the Hopper
kernels' registers, run on the portable kernels).

Layers, bottom up (as :mod:`solattn.interface`):

1. the registry (:mod:`solattn.flex.registry`): :func:`~solattn.flex.registry.resolve` turns a
   mod into ``(key, captured tensors)``; the ops take the key and the tensors;
2. ``solattn::flex_fwd -> (out, lse)`` and ``solattn::flex_bwd -> (dq, dk, dv, [d captured])``,
   ``torch.library.custom_op``s with fake implementations (``torch.compile(fullgraph=True)``
   traces through them);
3. ``register_autograd`` on ``solattn::flex_fwd``: gradients for q, k, v, and for the score_mod's
   captured tensors that require grad (fp32 atomics: not bitwise reproducible). In eager mode
   the same functions run under a plain ``torch.autograd.Function`` (:class:`_EagerFlex`), or
   with no autograd when nothing requires a gradient: the ops' dispatch costs more host time
   than a mid-sized kernel takes;
4. :func:`flex_attention`, torch's signature and semantics.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from solattn.core import attn, make_params
from solattn.device import device_arch
from solattn.dispatch import (
    FLEX_BACKWARD,
    choose,
    hopper_unavailable,
    run_flex_backward,
    run_flex_forward,
)
from solattn.dropout import DropoutFields, draw_seed
from solattn.flex import block_mask as bm_lib
from solattn.flex.codegen import ModFns
from solattn.flex.registry import MASK, SCORE, check_devices, flat_args, mods, resolve
from solattn.launch import relaxed_capture_mode

# ---------------------------------------------------------------------------------------------
# normalized parameters of one call
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlexParams(DropoutFields):
    """Everything one flex call's kernels read, normalized once on the host."""

    scale: float
    group_size: int
    block_size: tuple[int, int]   # the BlockMask's (q, kv) block: the kernels' tiles divide it
    lists: tuple                  # kernel_lists(): 8 int32 tensors (B, H, rows[, max])
    score: Optional[ModFns]
    mask: Optional[ModFns]
    score_caps: tuple
    mask_caps: tuple
    # Attention dropout (kernel_options["dropout_p"]) and the call's (1,) int64 seed
    # (solattn.dropout); the same mask as flash_attn_func's for the same seed.
    dropout_p: float = 0.0
    dropout_seed: Optional[Tensor] = None

    @property
    def qk_scale(self) -> float:
        return self.scale * math.log2(math.e)

    @property
    def score_fwd(self):
        return self.score.fwd if self.score is not None else None

    @property
    def score_bwd(self):
        return self.score.bwd if self.score is not None else None

    @property
    def mask_fwd(self):
        return None if self.mask is None or self.mask.noop else self.mask.fwd

    def _list(self, i) -> tuple:
        args = getattr(self.lists, "args", None)  # bm_lib.KernelLists: built once
        if args is not None:
            return args[i // 2]
        return bm_lib.list_args(self.lists[i], self.lists[i + 1])

    def kv_list(self):
        return self._list(0)

    def mean_kv_blocks(self) -> Optional[float]:
        """The BlockMask's listed key blocks per query block (``KernelLists.mean_kv_blocks``:
        one host synchronization per BlockMask), or None where reading it would synchronize
        in the wrong place: lists rebuilt per call (under torch.compile), or a CUDA graph
        capture that no eager call with the same BlockMask preceded."""
        lists = self.lists
        if not isinstance(lists, bm_lib.KernelLists):
            return None
        kept = lists._mean_kv_blocks  # (read once: a repeated call asks nothing else)
        if kept is not None:
            return kept
        return lists.mean_kv_blocks(
            read=not (lists[0].is_cuda and torch.cuda.is_current_stream_capturing()))

    def full_kv_list(self):
        return self._list(2)

    def q_list(self):
        return self._list(4)

    def full_q_list(self):
        return self._list(6)

    def score_args(self) -> tuple:
        return flat_args(self.score_caps)

    def mask_args(self) -> tuple:
        return flat_args(self.mask_caps)

    def grad_buffers(self) -> list:
        """fp32 zero buffers for the gradients of the score_mod's captured tensors that
        require grad (in ModFns.grad_captures order)."""
        if self.score is None:
            return []
        return [torch.zeros(self.score_caps[i].shape, dtype=torch.float32,
                            device=self.score_caps[i].device)
                for i in self.score.grad_captures]

    def grad_args(self, grads) -> tuple:
        out = []
        for g in grads:
            out += [g, *g.stride()]
        return tuple(out)


def _params(q, k, lists, score_caps, mask_caps, dropout_seed, score_key, mask_key, scale,
            block_m, block_n, dropout_p):
    return FlexParams(scale=scale, group_size=q.shape[1] // k.shape[1],
                      block_size=(block_m, block_n),
                      lists=lists if isinstance(lists, tuple) else tuple(lists),
                      score=mods(score_key),
                      mask=mods(mask_key), score_caps=tuple(score_caps),
                      mask_caps=tuple(mask_caps), dropout_p=dropout_p,
                      dropout_seed=dropout_seed)


# ---------------------------------------------------------------------------------------------
# custom ops + autograd
# ---------------------------------------------------------------------------------------------

def _flex_forward(q, k, v, fp: FlexParams):
    """Flex forward on validated ``(B, H, L, E)`` inputs and their :class:`FlexParams` ->
    ``(out (B, H, L, Ev), lse (B, H, L) fp32, natural log)``, on the kernel
    :data:`solattn.dispatch.FLEX_FORWARD` picks."""
    return run_flex_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), fp)


# Signatures whose Hopper flex backward _prefetch_backward has started compiling (bounded: emptied
# when full), and its threads not yet joined.
_PREFETCHED: set = set()
_PREFETCHING: list = []


def _prefetch_backward(q, k, v, fp: FlexParams):
    """The first time a signature's forward runs with inputs that require grad, prepare its
    Hopper flex backward (compile the kernel: its route's plan, :data:`solattn.dispatch.
    FLEX_BACKWARD`) on a helper thread while the forward compiles and runs: Triton's compiler
    leaves the GIL for most of its work
    (two kernels compiled on two threads took half the time of one after the other, 2-core CPU
    machine), so a new mod's first backward finds its kernel compiled. Its stand-in dO has
    the layout of flex's output (``(B, H, L, Ev)`` contiguous, as ``out.sum().backward()``
    and most callers hand back); a dO of another layout reuses the compiled kernel with a new
    plan. Not from a forward inside a CUDA graph capture; a capture that another thread starts
    while the helper runs is left intact (the helper's driver calls run in
    :func:`~solattn.launch.relaxed_capture_mode`, without which its kernel's module load
    invalidated such a capture: ``test_hopper_flex_backward_prefetch_beside_a_capture``). The
    backward joins the helper first (:func:`_join_prefetch`); an error there is left to the
    backward to raise."""
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, fp.score_fwd, fp.mask_fwd, fp.scale,
           fp.group_size, fp.block_size, fp.has_dropout)
    if key in _PREFETCHED:
        return
    if len(_PREFETCHED) >= 1024:
        _PREFETCHED.clear()
    _PREFETCHED.add(key)
    if (hopper_unavailable(device_arch(q.device), q.device)
            or torch.cuda.is_current_stream_capturing()):
        return
    # (on the meta device: the plan reads its strides; the compile, its dtype)
    dout = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device="meta")
    t = (lambda x: x.transpose(1, 2))

    def prepare():
        try:
            with relaxed_capture_mode(), torch.cuda.device(q.device):
                choose(FLEX_BACKWARD, (t(dout), t(q), t(k), t(v), None, None, fp))
        except Exception:  # noqa: BLE001 - the backward prepares again and raises there
            pass

    thread = threading.Thread(target=prepare, name="solattn-flex-backward-compile", daemon=True)
    _PREFETCHING.append(thread)
    thread.start()


def _join_prefetch():
    """Wait for the backward compiles :func:`_prefetch_backward` started (from any thread: a
    list's pop is atomic, and another backward may empty it first)."""
    while True:
        try:
            thread = _PREFETCHING.pop()
        except IndexError:
            return
        thread.join()


def _flex_backward(dout, q, k, v, out, lse, dlse, fp: FlexParams):
    """Gradients ``(dq, dk, dv, [fp32 grads of the score_mod's captured tensors that require
    grad])`` of :func:`_flex_forward`."""
    if _PREFETCHING:
        _join_prefetch()
    if fp.score is not None and fp.score.bwd is None:
        raise NotImplementedError(
            f"flex_attention: the score_mod `{fp.score.name}` is a @triton.jit function: "
            "solattn cannot differentiate it (write it in PyTorch for the backward)")
    t = (lambda x: x.transpose(1, 2))
    return run_flex_backward(t(dout), t(q), t(k), t(v), t(out), lse, dlse, fp)


@torch.library.custom_op("solattn::flex_fwd", mutates_args=())
def _flex_fwd_op(q: Tensor, k: Tensor, v: Tensor, lists: list[Tensor], score_caps: list[Tensor],
                 mask_caps: list[Tensor], dropout_seed: Optional[Tensor], score_key: int,
                 mask_key: int, scale: float, block_m: int, block_n: int,
                 dropout_p: float) -> tuple[Tensor, Tensor]:
    """:func:`_flex_forward` as a custom op (what ``torch.compile`` traces). ``score_key`` /
    ``mask_key`` index the mod registry (-1: none); ``dropout_seed`` (with ``dropout_p > 0``)
    is drawn outside the op, as for ``solattn::fwd``."""
    return _flex_forward(q, k, v, _params(q, k, lists, score_caps, mask_caps, dropout_seed,
                                          score_key, mask_key, scale, block_m, block_n,
                                          dropout_p))


@_flex_fwd_op.register_fake
def _flex_fwd_fake(q, k, v, lists, score_caps, mask_caps, dropout_seed, score_key, mask_key, scale,
                   block_m, block_n, dropout_p):
    b, h, s, _ = q.shape
    return q.new_empty(b, h, s, v.shape[-1]), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("solattn::flex_bwd", mutates_args=())
def _flex_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 dlse: Optional[Tensor], lists: list[Tensor], score_caps: list[Tensor],
                 mask_caps: list[Tensor], dropout_seed: Optional[Tensor], score_key: int,
                 mask_key: int, scale: float, block_m: int, block_n: int,
                 dropout_p: float) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """:func:`_flex_backward` as a custom op (the backward of :func:`_flex_fwd_op`)."""
    fp = _params(q, k, lists, score_caps, mask_caps, dropout_seed, score_key, mask_key, scale,
                 block_m, block_n, dropout_p)
    return _flex_backward(dout, q, k, v, out, lse, dlse, fp)


@_flex_bwd_op.register_fake
def _flex_bwd_fake(dout, q, k, v, out, lse, dlse, lists, score_caps, mask_caps, dropout_seed,
                   score_key, mask_key, scale, block_m, block_n, dropout_p):
    fns = mods(score_key)
    grads = [] if fns is None else [score_caps[i].new_empty(score_caps[i].shape,
                                                            dtype=torch.float32)
                                    for i in fns.grad_captures]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), grads


def _setup_context(ctx, inputs, output):
    q, k, v, lists, score_caps, mask_caps, dropout_seed = inputs[:7]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, dropout_seed, *lists, *score_caps, *mask_caps)
    ctx.sizes = (len(lists), len(score_caps))
    ctx.scalars = inputs[7:]  # score_key ... dropout_p


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, dropout_seed, *rest = ctx.saved_tensors
    n_lists, n_score = ctx.sizes
    lists, score_caps, mask_caps = rest[:n_lists], rest[n_lists:n_lists + n_score], rest[
        n_lists + n_score:]
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, grads = _flex_bwd_op(dout, q, k, v, out, lse, dlse, list(lists),
                                     list(score_caps), list(mask_caps), dropout_seed,
                                     *ctx.scalars)
    cap_grads: list = [None] * n_score
    fns = mods(ctx.scalars[0])
    for i, g in zip(fns.grad_captures if fns is not None else (), grads):
        cap_grads[i] = g.to(score_caps[i].dtype)
    return (dq, dk, dv, [None] * n_lists, cap_grads, [None] * len(mask_caps), None,
            *[None] * len(ctx.scalars))


_flex_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFlex(torch.autograd.Function):
    """Eager-mode autograd over :func:`_flex_forward` / :func:`_flex_backward` (what the custom
    ops run): the ops' dispatch and autograd wrapper cost hundreds of microseconds of host time
    a call (H200, torch 2.11, 2026-11-26: a B4 H16 L4096 document-mask forward whose kernel
    takes 238 us measured 813 us through them with inputs that require grad), more than the
    kernel. The score_mod's captured tensors follow ``q, k, v`` so that they get gradients."""

    @staticmethod
    def forward(ctx, fp, q, k, v, *score_caps):
        _prefetch_backward(q, k, v, fp)
        out, lse = _flex_forward(q, k, v, fp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.fp = fp
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        fp = ctx.fp
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv, grads = _flex_backward(dout, q, k, v, out, lse, dlse, fp)
        cap_grads: list = [None] * len(fp.score_caps)
        for i, g in zip(fp.score.grad_captures if fp.score is not None else (), grads):
            cap_grads[i] = g.to(fp.score_caps[i].dtype)
        return (None, dq, dk, dv, *cap_grads)


def _flex(q, k, v, lists, score_caps, mask_caps, seed, score_key, mask_key, scale, block,
          dropout_p):
    """``(out, lse)`` of validated inputs, differentiable: the custom op while
    ``torch.compile`` traces, else :class:`_EagerFlex`, or no autograd at all when nothing
    requires a gradient (the pattern of :func:`solattn.core.attn`)."""
    args = (lists, score_caps, mask_caps, seed, score_key, mask_key, scale, block[0], block[1],
            dropout_p)
    if torch.compiler.is_compiling():
        return _flex_fwd_op(q, k, v, *args)
    fp = _params(q, k, *args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *score_caps)):
        return _EagerFlex.apply(fp, q, k, v, *score_caps)
    return _flex_forward(q, k, v, fp)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------

# torch's FlexKernelOptions: tuning knobs of torch's own kernels. They do not change results,
# solattn's kernels take their tiles from solattn.configs, so they are accepted and ignored.
# solattn's own option, "dropout_p" (torch's flex_attention has no dropout), is read by
# flex_attention.
_IGNORED_KERNEL_OPTIONS = {
    "num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
    "BLOCK_N2", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ",
    "FORCE_USE_FLEX_ATTENTION", "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu",
}


def _check_kernel_options(kernel_options):
    if kernel_options is None:
        return
    for name, value in dict(kernel_options).items():
        base = name[4:] if name.startswith(("fwd_", "bwd_")) else name
        if name == "dropout_p":
            from solattn.validation import check_dropout

            check_dropout(value)
        elif base == "BACKEND":
            if value not in ("AUTO", "TRITON"):
                raise NotImplementedError(f"kernel_options: BACKEND={value!r} is not available "
                                          "in solattn (its Triton kernels run every call)")
        elif base not in _IGNORED_KERNEL_OPTIONS:
            raise ValueError(f"kernel_options: unknown or unsupported option {name!r} (solattn "
                             f"ignores torch's tuning knobs {sorted(_IGNORED_KERNEL_OPTIONS)})")


def _check_inputs(query, key, value, enable_gqa, block_mask, scale):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (batch, heads, seqlen, headdim), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name}: expected dtype torch.float16 or torch.bfloat16, got "
                            f"{t.dtype} (solattn's kernels run fp16/bf16 with fp32 softmax)")
        if t.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} (query's), got {t.device}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"key/value: expected query's dtype {query.dtype}, got {key.dtype} / "
                        f"{value.dtype}")
    B, Hq, L, E = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"key/value: expected batch {B} (query's), got {key.shape[0]} / "
                         f"{value.shape[0]} (batch broadcasting is not supported)")
    if key.shape[-1] != E:
        raise ValueError(f"key: expected headdim {E} (query's), got {key.shape[-1]}")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value: expected (batch, heads, seqlen) {tuple(key.shape[:3])} (key's), "
                         f"got {tuple(value.shape[:3])}")
    if max(E, value.shape[-1]) > 256:
        raise ValueError(f"headdim: at most 256 supported, got {max(E, value.shape[-1])}")
    Hkv = key.shape[1]
    if not enable_gqa and Hkv != Hq:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got "
                         f"Hq={Hq} and Hkv={Hkv}. Try setting enable_gqa=True for GQA.")
    if Hq % Hkv:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but "
                         f"got Hq={Hq} and Hkv={Hkv}.")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if block_mask is not None:
        if not isinstance(block_mask, bm_lib.BlockMask):
            raise TypeError(f"block_mask: expected a BlockMask, got {type(block_mask).__name__}")
        if tuple(block_mask.seq_lengths) != (L, key.shape[2]):
            raise ValueError(
                f"block_mask was created for block_mask.shape={tuple(block_mask.shape)} but got "
                f"q_len={L} and kv_len={key.shape[2]}: create a new block mask for this length")
        if block_mask.kv_num_blocks.device != query.device:
            raise RuntimeError(f"Expect q/k/v and block_mask to be on the same device but got "
                               f"{query.device} and {block_mask.kv_num_blocks.device}.")


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None):
    """``torch.nn.attention.flex_attention.flex_attention`` on solattn's portable kernels.

    Same arguments and semantics as torch's, with no ``torch.compile`` needed: the Python
    ``score_mod`` / ``mask_mod`` are traced once and turned into Triton device code.

    Parameters
    ----------
    query : (B, Hq, L, E) fp16/bf16, CUDA (or CPU under TRITON_INTERPRET=1); any strides.
    key : (B, Hkv, S, E); ``value`` : (B, Hkv, S, Ev). ``Hkv < Hq`` needs ``enable_gqa=True``.
        Head dims up to 256.
    score_mod : ``(score, b, h, q_idx, kv_idx) -> score`` on the scaled score
        ``q.k * scale`` (fp32, natural units); ``b, h, q_idx, kv_idx`` int32 scalars (``h`` the
        query head). May index captured tensors (``bias[h, q_idx - kv_idx]``); those that
        require grad get gradients. Or a ``@triton.jit`` function on tiles (forward only).
    block_mask : a BlockMask from :func:`create_block_mask` (solattn's or torch's): only
        listed blocks are computed, ``mask_mod`` runs only on partial blocks. None: no mask.
    scale : default ``1 / sqrt(E)``.
    return_lse : also return the log-sum-exp (natural log, fp32 (B, Hq, L)).
    kernel_options : torch's tuning knobs are accepted and ignored; solattn's
        ``{"dropout_p": p}`` (float in [0, 1), training) applies attention dropout to the
        probabilities, with the same Philox mask and seed source as
        :func:`solattn.flash_attn_func`'s ``dropout_p`` (the LSE stays undropped); other
        options raise.
    return_aux : ``AuxRequest(lse=True)`` returns ``(out, AuxOutput(lse=...))``;
        ``max_scores`` is not supported.

    Returns
    -------
    out : (B, Hq, L, Ev) in query's dtype; rows that see no key are 0 (lse -inf).

    Differentiable in query, key, value and captured score_mod tensors; works under
    ``torch.compile(fullgraph=True)`` when the mods are defined outside the compiled function.
    The forward runs on the Hopper (Gluon) flex kernel on sm_90 where it applies (fp16/bf16,
    head dim 64 or 128 for q, k and v, 128 x 128 BlockMask blocks, mods traced from PyTorch,
    no dropout, and the compiled kernel spill-free: :mod:`solattn.kernels.hopper.flex_forward`),
    else on the portable Triton kernel; the backward likewise on the Hopper flex backward
    (:mod:`solattn.kernels.hopper.flex_backward`) or the portable kernels.
    """
    _check_inputs(query, key, value, enable_gqa, block_mask, scale)
    _check_kernel_options(kernel_options)
    want_lse = return_lse
    if return_aux is not None:
        if return_lse:
            raise ValueError("Cannot specify both return_lse and return_aux.")
        if getattr(return_aux, "max_scores", False):
            raise NotImplementedError("return_aux: max_scores is not supported by solattn")
        want_lse = bool(getattr(return_aux, "lse", False))
    B, H, L, E = query.shape
    S = key.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    dropout_p = float((kernel_options or {}).get("dropout_p", 0.0))

    if score_mod is None and block_mask is None:
        out, lse = _dense(query, key, value, scale, dropout_p)
    else:
        score_key, score_caps = resolve(score_mod, SCORE) if score_mod is not None else (-1, [])
        check_devices(score_caps, query.device, "score_mod")
        if block_mask is None:
            block, mask_key, mask_caps = (128, 128), -1, []
            lists = bm_lib.dense_lists(B, H, L, S, block, query.device,
                                       cache=not torch.compiler.is_compiling())
        else:
            block = tuple(block_mask.BLOCK_SIZE)
            bm_lib._block_sizes(block)
            if getattr(block_mask.mask_mod, "__name__", "") == "_sliced_mask_mod_error":
                raise RuntimeError("Cannot use mask_mod from a sliced BlockMask")
            mask_key, mask_caps = resolve(block_mask.mask_mod, MASK)
            check_devices(mask_caps, query.device, "mask_mod")
            lists = bm_lib.kernel_lists(block_mask, B, H, L, S,
                                        cache=not torch.compiler.is_compiling())
        if min(L, S) == 0:
            out = query.new_zeros(B, H, L, value.shape[-1])
            lse = torch.full((B, H, L), float("-inf"), device=query.device)
        else:
            seed = draw_seed(query.device) if dropout_p > 0 else None
            out, lse = _flex(query, key, value, lists, score_caps, mask_caps, seed, score_key,
                             mask_key, scale, block, dropout_p)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse if want_lse else None)
    return (out, lse) if want_lse else out


def _dense(query, key, value, scale, dropout_p):
    """No score_mod and no mask: the dense kernels do it best (flash_attn_func's path, on inputs
    :func:`_check_inputs` validated)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse = attn(q, k, v, make_params(q, k, dropout_p=dropout_p, softmax_scale=scale))
    return out.transpose(1, 2), lse
