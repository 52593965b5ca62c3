"""``ring`` (under ``torchrun``): ring attention (``solattn.distributed``) forward + backward
across the ranks' GPUs, against one GPU running flash_attn_func on the whole sequence.

    torchrun --nproc_per_node 2 -m solattn.cli bench --suite ring

B1 Hq32 Hkv8 D128 causal, bf16, 128k and 256k tokens (``--quick``: 128k). Each timed iteration
runs between a barrier and a device synchronization on every rank; a round's time is the
slowest rank's, and the table gives the median of rounds. TFLOP/s count the whole problem's
forward + backward FLOPs (:func:`solattn.bench.core.attn_flops`); "per GPU" divides by the
world size. Without a GPU (``TRITON_INTERPRET=1``, gloo) the ranks check their result against
the float64 reference on a tiny problem instead.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..core import Shape, attn_flops
from ..results import make_record


def _wall(fn, device) -> float:
    import torch.distributed as dist

    dist.barrier()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64,
                      device=device if device == "cuda" else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms.item())


def run(ctx, res, out=print) -> dict:
    import torch.distributed as dist

    from solattn import flash_attn_func
    from solattn.distributed import ring_attention, shard_sequence, unshard_sequence

    summary = {"rows": 0, "checked": [], "failed": [], "not_run": {}, "ran": set()}
    if "RANK" not in os.environ:
        summary["not_run"]["ring"] = ("needs torchrun: torchrun --nproc_per_node 2 -m "
                                      "solattn.cli bench --suite ring")
        out(summary["not_run"]["ring"])
        return summary
    cuda = not ctx.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    lengths = [64 * world] if ctx.cpu else ([131072] if ctx.quick else [131072, 262144])
    h, h_kv, d = (2, 1, 32) if ctx.cpu else (32, 8, 128)
    for L in lengths:
        shape = Shape(1, h, L, L, d, causal=True, h_kv=h_kv)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, L, n, d, generator=g, device=device, dtype=ctx.dtype)
                   for n in (h, h_kv, h_kv))
        do = torch.randn(1, L, h, d, generator=g, device=device, dtype=ctx.dtype)
        ql, kl, vl = (shard_sequence(t, dim=1).detach().requires_grad_() for t in (q, k, v))
        dol = shard_sequence(do, dim=1)

        def ring_step():
            out_l = ring_attention(ql, kl, vl, causal=True)
            torch.autograd.grad(out_l, (ql, kl, vl), dol)
            return out_l

        out_l = ring_step()
        summary["rows"] += 1
        if ctx.cpu:
            from solattn.reference import attention_ref

            full = unshard_sequence(out_l.detach(), dim=1)
            err = (full.double() - attention_ref(q.double(), k.double(), v.double(),
                                                 causal=True)[0]).abs().max().item()
            entry = f"ring: {shape.label()} world {world}: max err {err:.1e}"
            (summary["checked"] if err <= 2e-2 else summary["failed"]).append(entry)
            summary["ran"].add("solattn-ring")
            continue
        rounds = [_wall(ring_step, device) for _ in range(ctx.rounds)]
        single = None
        if rank == 0:
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))

            def one_gpu():
                torch.autograd.grad(flash_attn_func(qs, ks, vs, causal=True), (qs, ks, vs), do)

            try:
                one_gpu()
                torch.cuda.synchronize()
                single = []
                for _ in range(ctx.rounds):
                    t0 = time.perf_counter()
                    one_gpu()
                    torch.cuda.synchronize()
                    single.append((time.perf_counter() - t0) * 1e3)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        dist.barrier()
        if rank != 0:
            continue
        flops = attn_flops(shape, direction="fwdbwd")
        ms = statistics.median(rounds)
        spread = (max(rounds) - min(rounds)) / ms
        res.add(make_record("fwdbwd", f"solattn-ring{world}", shape, ms=ms,
                            value=flops / ms / 1e9, rounds=rounds, spread=spread, world=world))
        line = (f"| {shape.label()} | ring x{world}: {flops / ms / 1e9:.0f} TFLOP/s "
                f"({flops / ms / 1e9 / world:.0f} per GPU, spread {100 * spread:.1f}%)")
        if single:
            ms1 = statistics.median(single)
            res.add(make_record("fwdbwd", "solattn", shape, ms=ms1, value=flops / ms1 / 1e9,
                                rounds=single))
            line += f" | one GPU: {flops / ms1 / 1e9:.0f} TFLOP/s | speed-up {ms1 / ms:.2f}x |"
        else:
            line += " | one GPU: out of memory | - |"
        out(line)
    return summary
