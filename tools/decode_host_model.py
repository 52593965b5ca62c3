"""Host time of one attention call in a transformers decode step (batch 1, q_len 1, dynamic
cache), ``"solattn"`` against ``"sdpa"``, through their ``AttentionInterface`` functions.

    PYTHONPATH=$PWD python3 tools/decode_host_model.py [--steps 64] [--layers 8] [--profile]

A dynamic cache concatenates each new token: every layer's K and V are new tensors of a new
length at every step. This script builds those tensors ahead of time (TinyLlama's attention:
32 query heads, 4 KV heads, d=64, a 512-token prompt), then times the attention calls alone:
``steps x layers`` calls back to back with one synchronize at each end, so the wall time per call
is the host time whenever it exceeds the GPU time (a few microseconds here). ``--profile``
prints cProfile's top functions (own time) of the solattn calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


class _Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 8

    def __init__(self, idx):
        super().__init__()
        self.layer_idx = idx


def build(steps, layers, prompt=512, hq=32, hkv=4, d=64):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    calls = []
    for layer in range(layers):
        k = torch.randn(1, hkv, prompt, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        seq = []
        for _ in range(steps):
            k = torch.cat([k, torch.randn(1, hkv, 1, d, device=dev, dtype=dt)], dim=2)
            v = torch.cat([v, torch.randn(1, hkv, 1, d, device=dev, dtype=dt)], dim=2)
            seq.append((torch.randn(1, hq, 1, d, device=dev, dtype=dt), k, v))
        calls.append(seq)
    # step-major, like a model: step t runs layer 0, 1, ... on that step's tensors
    return [(_Layer(layer), *calls[layer][t]) for t in range(steps) for layer in range(layers)]


def per_call_us(fn, calls):
    for m, q, k, v in calls[:8]:
        fn(m, q, k, v, None, scaling=0.125)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for m, q, k, v in calls:
        fn(m, q, k, v, None, scaling=0.125)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / len(calls) * 1e6


def breakdown(steps, layers):
    """Per-call host time of each layer under ``solattn_attention_forward`` on the same call
    sequence (new tensors every step): where the microseconds go, without a profiler's
    overhead. Each layer's arguments are prepared outside the timing."""
    import torch.nn.functional as F

    from solattn.core import attn_forward
    from solattn.interface import _batched_params, flash_attn_func
    from solattn.kernels.hopper import forward_plan as hopper

    calls = build(steps, layers)
    bshd = [(m, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) for m, q, k, v in calls]
    params = [_batched_params(q, k, v, 0.0, 0.125, True, (-1, -1), 0.0, None, False)
              for _, q, k, v in bshd]
    stages = {
        "flash_attn_func": lambda i: flash_attn_func(*bshd[i][1:], softmax_scale=0.125,
                                                     causal=True),
        "_batched_params": lambda i: _batched_params(*bshd[i][1:], 0.0, 0.125, True, (-1, -1),
                                                     0.0, None, False),
        "attn_forward": lambda i: attn_forward(*bshd[i][1:], params[i]),
        "hopper.attn_fwd": lambda i: hopper.attn_fwd(*bshd[i][1:], params[i]),
        "torch sdpa (enable_gqa)": lambda i: F.scaled_dot_product_attention(
            *calls[i][1:], scale=0.125, enable_gqa=True),
    }
    for name, fn in stages.items():
        for i in range(8):
            fn(i)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(len(calls)):
            fn(i)
        torch.cuda.synchronize()
        print(f"breakdown {name}: {(time.perf_counter() - t) / len(calls) * 1e6:.1f} us per call",
              flush=True)


def pieces(steps, layers):
    """The Hopper launcher's parts, each timed over the same call sequence: the plan lookup,
    the two output allocations, the four descriptors (new tensors: built or copied), the
    launch with descriptors made beforehand."""
    from solattn.interface import _batched_params
    from solattn.kernels.hopper import forward_plan as hopper

    calls = build(steps, layers)
    bshd = [(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) for _, q, k, v in calls]
    params = [_batched_params(q, k, v, 0.0, 0.125, True, (-1, -1), 0.0, None, False)
              for q, k, v in bshd]
    n = len(calls)
    plans = [hopper._plan(q, k, v, p, True, None) for (q, k, v), p in zip(bshd, params)]
    outs = [torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
            for q, _, v in bshd]
    lses = [torch.empty(pl.lse_shape, dtype=torch.float32, device="cuda") for pl in plans]
    descs = [(pl.q_desc(q), pl.k_desc(k), pl.v_desc(v), pl.o_desc(o))
             for pl, (q, k, v), o in zip(plans, bshd, outs)]

    def t(fn):
        for i in range(8):
            fn(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    fresh = build(steps, layers)  # new tensors: descriptor misses as in a model
    fb = [(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) for _, q, k, v in fresh]
    res = {
        "plan lookup": t(lambda i: hopper._plan(*bshd[i], params[i], True, None)),
        "2x torch.empty": t(lambda i: (torch.empty(outs[i].shape, dtype=outs[i].dtype,
                                                   device=outs[i].device),
                                       torch.empty(lses[i].shape, dtype=torch.float32,
                                                   device=lses[i].device))),
        "4 descriptors, new tensors": t(lambda i: (plans[i].q_desc(fb[i][0]),
                                                   plans[i].k_desc(fb[i][1]),
                                                   plans[i].v_desc(fb[i][2]),
                                                   plans[i].o_desc(outs[i]))),
        "launch": t(lambda i: plans[i].launch(*descs[i], outs[i], lses[i], bshd[i][0],
                                              bshd[i][0], bshd[i][0])),
        "hopper.attn_fwd": t(lambda i: hopper.attn_fwd(*bshd[i], params[i])),
    }
    for k, v in res.items():
        print(f"pieces {k}: {v:.1f} us per call", flush=True)


def gpu_time(prompt=544):
    """GPU time of one decode call (replayed in a CUDA graph, no host in the way) at a
    ``prompt``-key cache: our flash_attn_func (what the backend calls), torch SDPA, and
    flash_attn_with_kvcache (the split-KV decode kernel) over the same keys."""
    import torch.nn.functional as F
    from toolkit import graph_us  # (tools/ is this script's import path)

    from solattn import flash_attn_func, flash_attn_with_kvcache

    q = torch.randn(1, 1, 32, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, prompt, 4, 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fns = {"flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True),
           "torch sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
           "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(q, k, v, causal=True)}
    for name, fn in fns.items():
        print(f"gpu time {name}: {graph_us(fn, n=500):.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the layers under the backend function (see breakdown())")
    ap.add_argument("--pieces", action="store_true",
                    help="also time the parts of the Hopper launcher (see pieces())")
    ap.add_argument("--gpu-time", action="store_true",
                    help="also time one decode call's GPU work (see gpu_time())")
    args = ap.parse_args()

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from solattn import flash_attn_with_kvcache
    from solattn.integrations.transformers import solattn_attention_forward

    def kvcache_route(module, query, key, value, mask, scaling):
        """The step as a ``flash_attn_with_kvcache`` call over the whole (already appended)
        cache: its single-launch decode kernel instead of the prefill kernel."""
        out = flash_attn_with_kvcache(query.transpose(1, 2), key.transpose(1, 2),
                                      value.transpose(1, 2), softmax_scale=scaling, causal=True)
        return out, None

    impls = {"solattn": solattn_attention_forward, "sdpa": sdpa_attention_forward,
             "solattn via flash_attn_with_kvcache": kvcache_route}
    for rnd in range(3):  # fresh tensors each round: no plan cached from the previous round
        calls = build(args.steps, args.layers)
        for name, fn in impls.items():
            print(f"round {rnd} {name}: {per_call_us(fn, calls):.1f} us per call", flush=True)
    if args.breakdown:
        breakdown(args.steps, args.layers)
    if args.pieces:
        pieces(args.steps, args.layers)
    if args.gpu_time:
        gpu_time()
    if args.profile:
        calls = build(args.steps, args.layers)
        pr = cProfile.Profile()
        pr.enable()
        for m, q, k, v in calls:
            solattn_attention_forward(m, q, k, v, None, scaling=0.125)
        torch.cuda.synchronize()
        pr.disable()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(35)
            text = s.getvalue()
            print(f"\n--- cProfile, {len(calls)} solattn calls, by {key} ---")
            print(text[text.find("   ncalls"):].rstrip())


if __name__ == "__main__":
    main()
