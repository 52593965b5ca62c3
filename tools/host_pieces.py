"""Where the host time of a tiny flex forward and a tiny flash_attn_func forward + backward goes,
piece by piece, without a profiler's overhead: each piece runs N times back to back
(``time.perf_counter``, median of blocks), on the same inputs as ``solattn bench --suite host``.

    python3 tools/host_pieces.py [--n 2000] [--blocks 10]

The pieces call solattn's internals in the order one public call runs them; their sum need not
equal the whole call (caches warm, allocations reused differently), it says which part to cut.
Also: the autograd engine's floor (a ``torch.autograd.Function`` that launches nothing, and one
that allocates its outputs), to separate what our backward's Python costs from what any custom
autograd function costs; the same calls with the engine's worker threads off, and our backward
alone on another thread (does the thread it runs on matter?); and "ablations": the whole call
again with its internals replaced, one after the other, by their precomputed results.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import solattn
from solattn import dispatch
from solattn.flex import block_mask as bm_lib
from solattn.flex import ops
from solattn.flex.trace import MASK


def per_call_us(fn, n, blocks):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n // blocks):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / (n // blocks) * 1e6)
    return statistics.median(times)


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        return g, g, g


class _Allocates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=10)
    args = ap.parse_args()
    dev, dt, L = "cuda", torch.bfloat16, 256
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    q, k, v = (torch.randn(1, 2, L, 128, device=dev, dtype=dt) for _ in range(3))
    docs = torch.arange(L, device=dev) // (L // 4)

    def doc_mask(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    bm = solattn.create_block_mask(doc_mask, None, None, L, L, device=dev)
    scale = 1 / 128 ** 0.5
    lists = bm_lib.kernel_lists(bm, 1, 2, L, L)
    mask_key, mask_caps = ops.resolve(doc_mask, MASK)
    fp = ops._params(q, k, lists, [], mask_caps, None, -1, mask_key, scale, 128, 128, 0.0)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    route, prepared = dispatch.choose(dispatch.FLEX_FORWARD, (qt, kt, vt, fp))
    from solattn.kernels.hopper import flex_forward_plan
    from solattn.launch import _tuple_spec

    qp, kp, vp, plan = prepared
    out = q.new_empty(1, 2, L, 128)
    lse = q.new_empty(1, 2, L, dtype=torch.float32)
    call_args = flex_forward_plan._call_args(plan, qp, kp, vp, out, lse, fp)
    pieces = {
        "flex: whole call (no grad)": lambda: solattn.flex_attention(q, k, v, block_mask=bm),
        "flex: _check_inputs": lambda: ops._check_inputs(q, k, v, False, bm, None),
        "flex: resolve(mask_mod)": lambda: ops.resolve(doc_mask, MASK),
        "flex: kernel_lists": lambda: bm_lib.kernel_lists(bm, 1, 2, L, L),
        "flex: _params": lambda: ops._params(q, k, lists, [], mask_caps, None, -1, mask_key,
                                             scale, 128, 128, 0.0),
        "flex: 3 transposes": lambda: (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "flex: dispatch.choose (decision + plan)": lambda: dispatch.choose(
            dispatch.FLEX_FORWARD, (qt, kt, vt, fp)),
        "flex: attn_fwd_flex (alloc + args + launch)":
            lambda: flex_forward_plan.attn_fwd_flex(prepared, fp),
        "flex: 2 new_empty": lambda: (q.new_empty(1, 2, L, 128),
                                      q.new_empty(1, 2, L, dtype=torch.float32)),
        "flex: _call_args": lambda: flex_forward_plan._call_args(plan, qp, kp, vp, out, lse, fp),
        "flex: _tuple_spec": lambda: _tuple_spec(call_args[5:]),
        "flex: plan.launch": lambda: plan.launch(*call_args),
    }
    qa, ka, va = (torch.randn(1, 128, 8, 64, device=dev, dtype=dt, requires_grad=True)
                  for _ in range(3))
    g = torch.randn(1, 128, 8, 64, device=dev, dtype=dt)
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (qa, ka, va))
    gs = g.transpose(1, 2)
    from solattn import core, interface

    ap_ = interface._batched_params(qa, ka, va, 0.0, None, True, (-1, -1), 0.0, None, False)
    with torch.no_grad():
        o_, lse_ = core.attn_forward(qa, ka, va, ap_)
    pieces.update({
        "fa: _batched_params": lambda: interface._batched_params(
            qa, ka, va, 0.0, None, True, (-1, -1), 0.0, None, False),
        "fa: attn_forward": lambda: core.attn_forward(qa, ka, va, ap_),
        "fa: attn_backward": lambda: core.attn_backward(g, qa, ka, va, o_, lse_, ap_),
        "fa: fwd+bwd causal": lambda: solattn.flash_attn_func(qa, ka, va, causal=True).backward(g),
        "fa: fwd causal (grad inputs)": lambda: solattn.flash_attn_func(qa, ka, va, causal=True),
        "sdpa: fwd+bwd causal": lambda: F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True).backward(gs),
        "engine floor: Function, nothing": lambda: _Nothing.apply(qa, ka, va).backward(g),
        "engine floor: Function, 4 empty_like": lambda: _Allocates.apply(qa, ka, va).backward(g),
        "engine floor: autograd.grad, nothing": lambda: torch.autograd.grad(
            _Nothing.apply(qa, ka, va), (qa, ka, va), g),
    })
    for name, fn in pieces.items():
        print(f"{name:<48} {per_call_us(fn, args.n, args.blocks):8.1f} us", flush=True)
    threads(args, pieces, lambda: core.attn_backward(g, qa, ka, va, o_, lse_, ap_))
    ablations(args, q, k, v, bm, doc_mask, prepared, fp, qa, ka, va, g, ap_, o_, lse_)


def threads(args, pieces, backward):
    """Whether the backward's host time depends on the thread it runs on: the autograd engine
    runs a CUDA graph's backward nodes on its own device thread (the calling thread waits), so
    the same calls again with the engine's worker threads off (the calling thread runs them),
    and our backward alone on another Python thread."""
    import threading

    with torch.autograd.set_multithreading_enabled(False):
        for name in ("fa: fwd+bwd causal", "sdpa: fwd+bwd causal",
                     "engine floor: Function, nothing"):
            us = per_call_us(pieces[name], args.n, args.blocks)
            print(f"{name + ' (engine threads off)':<48} {us:8.1f} us", flush=True)
    result = []
    worker = threading.Thread(target=lambda: result.append(
        per_call_us(backward, args.n, args.blocks)))
    worker.start()
    worker.join()
    print(f"{'fa: attn_backward on another thread':<48} {result[0]:8.1f} us", flush=True)


def ablations(args, q, k, v, bm, doc_mask, prepared, fp, qa, ka, va, g, ap_, o_, lse_):
    """The whole call again with its internals replaced, cumulatively, by their precomputed
    results: what each costs inside the call (caches and code paths as a real call has them)."""
    from unittest import mock

    from solattn import core
    from solattn.kernels.hopper import flex_forward_plan

    res = {"mask": ops.resolve(doc_mask, MASK)}
    lists = bm_lib.kernel_lists(bm, 1, 2, 256, 256)
    out_lse = flex_forward_plan.attn_fwd_flex(prepared, fp)
    steps = [
        ("ops.resolve", mock.patch.object(ops, "resolve", lambda fn, kind: res["mask"])),
        ("ops._check_inputs", mock.patch.object(ops, "_check_inputs", lambda *a: None)),
        ("kernel_lists", mock.patch.object(bm_lib, "kernel_lists", lambda *a, **kw: lists)),
        ("dispatch.choose", mock.patch.object(
            dispatch, "choose", lambda *a: (dispatch.FLEX_FORWARD.routes[0], prepared))),
        ("flex_forward_plan.attn_fwd_flex (no launch)",
         mock.patch.object(flex_forward_plan, "attn_fwd_flex", lambda *a: out_lse)),
    ]
    run_ablation(args, "flex whole call",
                 lambda: solattn.flex_attention(q, k, v, block_mask=bm), steps)
    dq = (torch.empty_like(qa), torch.empty_like(ka), torch.empty_like(va))
    run_ablation(args, "fa fwd+bwd whole",
                 lambda: solattn.flash_attn_func(qa, ka, va, causal=True).backward(g), [
                     ("core.attn_backward (no launch)",
                      mock.patch.object(core, "attn_backward", lambda *a, **kw: dq)),
                     ("core.attn_forward (two clones instead)",
                      mock.patch.object(core, "attn_forward",
                                        lambda *a, **kw: (o_.clone(), lse_.clone()))),
                 ])


def run_ablation(args, name, whole, steps):
    """Time ``whole``, then again after each patch of ``steps`` (cumulative); undo them."""
    print(f"{'ablation: ' + name:<48} {per_call_us(whole, args.n, args.blocks):8.1f} us")
    active = []
    try:
        for step, patch in steps:
            patch.start()
            active.append(patch)
            print(f"{'  without ' + step:<48} {per_call_us(whole, args.n, args.blocks):8.1f} us",
                  flush=True)
    finally:
        for patch in reversed(active):
            patch.stop()

if __name__ == "__main__":
    main()
