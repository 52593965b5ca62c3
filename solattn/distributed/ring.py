"""Ring attention (context parallelism): exact attention over a sequence split across the ranks of
a ``torch.distributed`` process group.

Each rank keeps its queries and passes its K/V around the ring; at step ``s`` it attends its
queries to the K/V of rank ``r - s`` with solattn's kernels (the pieces of
:mod:`solattn.distributed.plan`, masks from global positions) and folds the partial output into
an fp32 accumulator by its log-sum-exp. The backward runs the ring again: each step recomputes its
pieces with the *global* output and LSE (:func:`solattn.core.attn_backward` needs them only
row by row), dQ accumulates locally in fp32, and the fp32 dK/dV accumulators travel with the K/V
they belong to and return to their owner after the last step. The next K/V (and dK/dV) are in
flight while a step computes (:mod:`solattn.distributed.comm`).

See ``docs/ring-attention.md`` for the layouts, the causal decomposition and a scaling model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solattn import validation as V
from solattn.core import attn_backward, attn_forward, make_params
from solattn.distributed.comm import Ring
from solattn.distributed.layout import check_layout, chunks_per_rank, group_rank_world
from solattn.distributed.plan import Piece, RingPlan, make_plan
from solattn.distributed.profile import step_timer


@dataclass(frozen=True)
class _RingCall:
    """Everything one ring_attention call decided on the host, shared by forward and backward."""

    ring: Ring
    plan: RingPlan
    softmax_scale: float | None
    softcap: float
    deterministic: bool

    def params(self, q, k, piece: Piece):
        """One piece's parameters; its forward output is float32 (merged without rounding)."""
        return make_params(q, k, softmax_scale=self.softmax_scale, causal=piece.causal,
                           window_size=piece.window, softcap=self.softcap,
                           deterministic=self.deterministic, out_dtype=torch.float32)


def _seq(t: torch.Tensor, s: slice) -> torch.Tensor:
    """Rows ``s`` of the sequence dim of a ``(b, s, h, d)`` tensor (a view)."""
    return t[:, s]


def _merge_(out_acc, lse_acc, out, lse) -> None:
    """Fold a partial result into the running one, in place, exactly (fp32):
    ``lse' = log(e^lse_acc + e^lse)``, ``out' = e^(lse_acc - lse') out_acc + e^(lse - lse') out``.

    ``out_acc (b, n, h, d_v)`` fp32, ``lse_acc (b, h, n)`` fp32 (views), ``out`` and ``lse``
    fp32 (the kernels' float32 output: no rounding to the input dtype before the merge). Rows
    empty in both stay (0, -inf) without NaN.
    """
    new = torch.logaddexp(lse_acc, lse)
    ref = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_acc = torch.exp(lse_acc - ref).transpose(1, 2).unsqueeze(-1)  # (b, n, h, 1)
    w_new = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).addcmul_(out, w_new)
    lse_acc.copy_(new)


def _ring_forward(q, k, v, call: _RingCall):
    """``(out (b, s, h, d_v) in q's dtype, lse (b, h, s) fp32)`` of the local queries."""
    b, s, h, _ = q.shape
    out_acc = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse_acc = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    plan, ring = call.plan, call.ring
    kv = [k, v]
    for step, pieces in enumerate(plan.steps):
        timer = step_timer("fwd", step, q.device, len(pieces))
        pending = ring.exchange(kv) if step + 1 < plan.num_steps else None
        parts = []
        for pc in pieces:
            qp, kp, vp = _seq(q, pc.q), _seq(kv[0], pc.k), _seq(kv[1], pc.k)
            parts.append((pc, *attn_forward(qp, kp, vp, call.params(qp, kp, pc), return_lse=True)))
        if timer:
            timer.mark("compute")
        for pc, out, lse in parts:
            _merge_(_seq(out_acc, pc.q), lse_acc[..., pc.q], out, lse)
        if timer:
            timer.mark("merge")
        if pending is not None:
            kv = pending.wait()
        if timer:
            timer.mark("wait")
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, dlse, q, k, v, out, lse, call: _RingCall):
    """``(dq, dk, dv)`` of the local shards; ``out``/``lse`` are the forward's (global) results."""
    plan, ring = call.plan, call.ring
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    dkv_pending = None
    for step, pieces in enumerate(plan.steps):
        last = step + 1 == plan.num_steps
        timer = step_timer("bwd", step, q.device, len(pieces))
        kv_pending = None if last else ring.exchange(kv)
        parts = []
        for pc in pieces:
            qp, kp, vp = _seq(q, pc.q), _seq(kv[0], pc.k), _seq(kv[1], pc.k)
            # The kernels read lse/dlse rows with unit stride per (b, h): a contiguous slice.
            lse_p = lse[..., pc.q].contiguous()
            dlse_p = None if dlse is None else dlse[..., pc.q]
            parts.append((pc, *attn_backward(_seq(dout, pc.q), qp, kp, vp, _seq(out, pc.q), lse_p,
                                             call.params(qp, kp, pc), dlse=dlse_p)))
        if timer:
            timer.mark("compute")
        if step == 0:
            dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for pc, dq_p, dk_p, dv_p in parts:
            _seq(dq_acc, pc.q).add_(dq_p)
        if timer:
            timer.mark("merge")
        if dkv_pending is not None:  # the dK/dV of this step's K/V, accumulated by the ranks before
            dk_acc, dv_acc = dkv_pending.wait()
        if timer:
            timer.mark("wait")
        for pc, dq_p, dk_p, dv_p in parts:
            _seq(dk_acc, pc.k).add_(dk_p)
            _seq(dv_acc, pc.k).add_(dv_p)
        if timer:
            timer.mark("merge")
        # Pass them on with the K/V; after the last step, back to their owner (rank - step).
        dkv_pending = ring.exchange([dk_acc, dv_acc], offset=1 if not last else -step)
        if kv_pending is not None:
            kv = kv_pending.wait()
        if timer:
            timer.mark("wait")
    timer = step_timer("bwd", plan.num_steps, q.device, 0)
    dk_acc, dv_acc = dkv_pending.wait()
    if timer:
        timer.mark("wait")
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _RingCall):
        out, lse = _ring_forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only the lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(dout, dlse, q, k, v, out, lse, ctx.call)
        return dq, dk, dv, None


def _check_inputs(q, k, v, softmax_scale, window_size, softcap, layout, world):
    V.check_tensor("q", q, 4, "(batch, seqlen_local, nheads, headdim)")
    V.check_tensor("k", k, 4, "(batch, seqlen_local, nheads_kv, headdim)")
    V.check_tensor("v", v, 4, "(batch, seqlen_local, nheads_kv, headdim_v)")
    V.check_dtypes(q=q, k=k, v=v)
    V.check_devices(q=q, k=k, v=v)
    b, s, h, d = q.shape
    V.check_dim("k", k.shape[0], b, "batch (q.shape[0])")
    V.check_dim("v", v.shape[0], b, "batch (q.shape[0])")
    V.check_dim("k", k.shape[1], s, "seqlen_local (q.shape[1]; ring attention is self-attention "
                "over one sequence split across the ranks)")
    V.check_dim("v", v.shape[1], s, "seqlen_local (q.shape[1])")
    V.check_dim("v", v.shape[2], k.shape[2], "nheads_kv (k.shape[2])")
    V.check_dim("k", k.shape[3], d, "headdim (q.shape[3])")
    V.check_heads(h, k.shape[2])
    V.check_head_dims(q, v)
    V.check_scalars(softmax_scale, window_size, softcap)
    check_layout(layout)
    per_rank = chunks_per_rank(layout)
    if s % per_rank:
        raise ValueError(
            f"q: expected the local sequence length (q.shape[1]) divisible by {per_rank} "
            f"(layout={layout!r} holds {per_rank} chunks per rank; the whole sequence must be "
            f"divisible by {per_rank * world}), got {s}")


def ring_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   group=None, layout="zigzag", return_lse=False, deterministic=False):
    """Exact attention over a sequence split across the ranks of a process group (ring attention).

    Every rank calls it with its own shard of ``q``, ``k``, ``v`` (see :func:`shard_sequence`);
    the result is this rank's shard of what :func:`solattn.flash_attn_func` returns on the whole
    sequence. The K/V shards travel around the ring (``world`` steps, fewer when a window needs
    fewer), overlapped with compute; the backward sends dK/dV around the ring back to their owner.

    Parameters
    ----------
    q : (batch, seqlen_local, nheads, headdim), fp16 or bf16, CUDA (NCCL) or CPU under
        ``TRITON_INTERPRET=1`` (gloo). ``seqlen_local = seqlen / world``.
    k : (batch, seqlen_local, nheads_kv, headdim); ``nheads % nheads_kv == 0`` (GQA/MQA: K/V
        travel with their own head count).
    v : (batch, seqlen_local, nheads_kv, headdim_v).
    causal : bool. The whole sequence's causal mask (square problem: query ``i`` sees keys
        ``j <= i`` in global positions).
    softmax_scale : float, default ``1 / sqrt(headdim)``.
    window_size : (left, right), -1 = unbounded: query ``i`` sees keys
        ``i - left <= j <= i + right`` (global positions; ``right`` is 0 with ``causal``).
    softcap : float >= 0. If > 0, scores are ``softcap * tanh(scale * q.k / softcap)``.
    group : torch.distributed.ProcessGroup, optional. The ring (default: the world). Without an
        initialized default group the world size is 1 and this is ``flash_attn_func``.
    layout : {"zigzag", "contiguous"}. How the sequence was split: ``"contiguous"``, rank ``r``
        holds chunk ``r`` of ``world``; ``"zigzag"`` (default), ``2 * world`` chunks, rank ``r``
        holds chunks ``r`` and ``2 * world - 1 - r`` (equal causal work on every rank).
    return_lse : also return this rank's rows of the log-sum-exp (natural log).
    deterministic : bitwise-reproducible backward (the ring's accumulation order is fixed; this
        makes each step's kernels deterministic too).

    Returns
    -------
    out : (batch, seqlen_local, nheads, headdim_v), q's dtype.
    lse : (batch, nheads, seqlen_local) float32, only with ``return_lse``.

    Differentiable in ``q``, ``k``, ``v`` (and through ``lse``). Every rank must call it with the
    same shapes and arguments (collective). Partial results are merged in fp32; each step's
    partial output comes out of the kernel in the input dtype.

    Raises
    ------
    ValueError / TypeError
        On the host, before any communication: shapes, dtypes, devices, arguments, and a local
        sequence length the layout cannot split (``"zigzag"`` needs it even).
    """
    rank, world = group_rank_world(group)
    _check_inputs(q, k, v, softmax_scale, window_size, softcap, layout, world)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    b, s, h, _ = q.shape
    if q.numel() == 0 or k.numel() == 0 or s == 0:  # the same on every rank: nothing to exchange
        out = q.new_zeros(b, s, h, v.shape[-1])
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    plan = make_plan(layout, rank, world, s, bool(causal), tuple(int(w) for w in window_size))
    call = _RingCall(Ring(group, rank, world), plan, softmax_scale, float(softcap),
                     bool(deterministic))
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), call)
    return (out, lse) if return_lse else out
