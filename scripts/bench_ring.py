"""Ring attention (solattn.distributed) forward + backward across GPUs, against one GPU running the
whole sequence and against torch's context parallelism (SDPA ring, cuDNN / flash backends).

    torchrun --nproc_per_node 2 scripts/bench_ring.py                 # 128k and 256k tokens
    torchrun --nproc_per_node 2 scripts/bench_ring.py --seqlens 131072 --iters 5
    # plumbing check on a CPU (gloo, Triton's interpreter; the times mean nothing):
    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 scripts/bench_ring.py --smoke

Shape: B1 Hq32 Hkv8 D128 causal, bf16 (change with --batch/--heads/--kv-heads/--head-dim).
FLOPs of the whole problem = 4 * B * H * L^2 * D / 2 (causal) x 3.5 for forward + backward
(``solattn.bench.core.attn_flops``); a multi-GPU TFLOP/s is that divided by the wall time (the
slowest rank), "per GPU" divides it by the world size too. Timing: ``--warmup`` untimed then
``--iters`` timed iterations, each between a barrier and a device synchronization on every rank;
the median over iterations of the max over ranks. Also reported: the ring's per-step compute /
merge / wait split (``ring_profile``, one extra iteration: ``wait`` is the communication that
compute did not hide), the time of one bare K/V (and fp32 dK/dV) exchange of a step, the output's
max error against the single-GPU output, and peak memory. Writes ``$OUT/bench_ring.json``
(``--out``), rank 0 prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from solattn import flash_attn_func
from solattn.bench.core import Shape, attn_flops, env_info
from solattn.distributed import ring_attention, ring_profile, shard_sequence, unshard_sequence
from solattn.distributed.comm import Ring


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="131072,262144", help="total tokens, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--peers", default="single,torch-cp-cudnn,torch-cp-flash",
                   help="which baselines to run (comma-separated; empty for none)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of the JSON")
    p.add_argument("--smoke", action="store_true",
                   help="CPU/gloo plumbing check at a tiny shape (TRITON_INTERPRET=1)")
    a = p.parse_args()
    if a.smoke:
        a.seqlens, a.heads, a.kv_heads, a.head_dim, a.iters = "64", 4, 2, 16, 1
    return a


# -------------------------------------------------------------------------------------------
# Timing across ranks
# -------------------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup: int, iters: int, group_all: bool = True) -> float:
    """Median over iterations of the slowest rank's wall time of ``fn()`` (ms). With
    ``group_all=False`` only this rank's time (for the single-GPU baseline)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if group_all:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ms = torch.tensor((time.perf_counter() - t0) * 1e3, dtype=torch.float64,
                          device=device)
        if group_all:
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        times.append(ms.item())
    return statistics.median(times)


def _peak_gib(device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _tflops(flops: float, ms: float) -> float:
    return round(flops / ms / 1e9, 1)


def full_dtype(args):
    return torch.float16 if args.smoke else torch.bfloat16  # the interpreter's bf16 is wrong


def _full_inputs(shape: Shape, dtype, device):
    """The whole problem, identical on every rank (one seed)."""
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    b, s = shape.b, shape.s_q
    return (mk(b, s, shape.h, shape.d), mk(b, s, shape.kv_heads, shape.d),
            mk(b, s, shape.kv_heads, shape.dv), mk(b, s, shape.h, shape.dv))


# -------------------------------------------------------------------------------------------
# The contenders
# -------------------------------------------------------------------------------------------

def bench_ring(shape, full, args, device, world):
    layout = args.layout
    q, k, v, dout = (shard_sequence(t, layout=layout).clone(memory_format=torch.contiguous_format)
                     for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return ring_attention(q, k, v, causal=shape.causal, layout=layout)

    def fwdbwd():
        out = ring_attention(q, k, v, causal=shape.causal, layout=layout)
        torch.autograd.grad(out, (q, k, v), dout)

    _reset_peak(device)
    res = dict(fwd_ms=time_ms(fwd, device, args.warmup, args.iters),
               fwdbwd_ms=time_ms(fwdbwd, device, args.warmup, args.iters))
    res["peak_mem_gib"] = _peak_gib(device)
    with ring_profile() as prof:
        dist.barrier()
        fwdbwd()
        steps = prof.steps()
    totals = prof.totals()
    all_steps = [None] * world
    all_totals = [None] * world
    dist.all_gather_object(all_steps, steps)
    dist.all_gather_object(all_totals, totals)
    res["profile"] = dict(per_rank_totals=all_totals, per_rank_steps=all_steps)
    with torch.no_grad():
        out = unshard_sequence(fwd(), layout=layout)
    return res, out


def bench_exchange(shape, args, device, world):
    """One step's bare transfers: the K/V shard (input dtype) and the fp32 dK/dV shard."""
    s_local = shape.s_q // world
    kv = [torch.randn(shape.b, s_local, shape.kv_heads, d, device=device, dtype=full_dtype(args))
          for d in (shape.d, shape.dv)]
    dkv = [t.float() for t in kv]
    ring = Ring(None, dist.get_rank(), world)
    res = {}
    for name, tensors in (("kv", kv), ("dkv_fp32", dkv)):
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        ms = time_ms(lambda: ring.exchange(tensors).wait(), device, 2, max(args.iters, 5))
        res[name] = dict(bytes=nbytes, ms=round(ms, 3),
                         gib_per_s=round(nbytes / ms / 1e-3 / 2**30, 1))
    return res


def bench_single(shape, full, args, device, ref_out):
    """Rank 0 alone runs flash_attn_func on the whole sequence; the other ranks wait."""
    res = None
    if dist.get_rank() == 0:
        q, k, v, dout = full
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return flash_attn_func(q, k, v, causal=shape.causal)

        def fwdbwd():
            out = flash_attn_func(q, k, v, causal=shape.causal)
            torch.autograd.grad(out, (q, k, v), dout)

        _reset_peak(device)
        res = dict(fwd_ms=time_ms(fwd, device, args.warmup, args.iters, group_all=False),
                   fwdbwd_ms=time_ms(fwdbwd, device, args.warmup, args.iters, group_all=False))
        res["peak_mem_gib"] = _peak_gib(device)
        out = fwd()
        res["ring_out_max_abs_err_vs_single"] = (ref_out.float() - out.float()).abs().max().item()
        del out
    dist.barrier()
    return res


_MESH: dict = {}


def bench_torch_cp(shape, full, args, device, backend_name):
    """torch.distributed.tensor.experimental.context_parallel around SDPA (SDPA layout
    (b, h, s, d)); GQA through ``enable_gqa``, else K/V expanded to all heads (noted)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[
        backend_name]
    if device.type not in _MESH:
        _MESH[device.type] = init_device_mesh(device.type, (dist.get_world_size(),))
    mesh = _MESH[device.type]
    note = []
    for gqa in (True, False):
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in full)
        if not gqa:
            rep = shape.h // shape.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        bufs = [q, k, v, dout]
        try:
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                                  no_restore_buffers=set(bufs)):
                ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
                kw = dict(is_causal=shape.causal, enable_gqa=gqa and shape.kv_heads != shape.h)

                def fwd():
                    with torch.no_grad(), sdpa_kernel([backend]):
                        return torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, **kw)

                def fwdbwd():
                    with sdpa_kernel([backend]):
                        out = torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, **kw)
                    torch.autograd.grad(out, (ql, kl, vl), dout)

                _reset_peak(device)
                res = dict(fwd_ms=time_ms(fwd, device, args.warmup, args.iters),
                           fwdbwd_ms=time_ms(fwdbwd, device, args.warmup, args.iters))
                res["peak_mem_gib"] = _peak_gib(device)
        except Exception as exc:  # report why the peer cannot run, keep benchmarking
            msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            note.append(("enable_gqa=True" if gqa else "K/V expanded") + f": {msg}")
            if dist.get_rank() == 0:
                traceback.print_exc(limit=-4)
            dist.barrier()
            continue
        res["gqa"] = "enable_gqa=True" if gqa else (
            f"K/V expanded to {shape.h} heads ({shape.h // shape.kv_heads}x the K/V traffic)")
        if note:
            res["notes"] = note
        return res
    return dict(error="; ".join(note))


# -------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.smoke or not torch.cuda.is_available():
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = [p for p in args.peers.split(",") if p]
    report = dict(env=env_info(), world=world, layout=args.layout, backend=backend,
                  timing="median over iterations of the max over ranks of barrier -> sync wall "
                         "time", results=[])
    try:
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            shape = Shape(b=args.batch, h=args.heads, s_q=seqlen, s_k=seqlen, d=args.head_dim,
                          causal=True, h_kv=args.kv_heads)
            flops = attn_flops(shape, direction="fwdbwd")
            flops_fwd = attn_flops(shape, direction="fwd")
            row = dict(shape=shape.as_dict(), label=shape.label(), flops_fwdbwd=flops)
            full = _full_inputs(shape, full_dtype(args), device)
            ring_res, ring_out = bench_ring(shape, full, args, device, world)
            ring_res.update(tflops_fwdbwd=_tflops(flops, ring_res["fwdbwd_ms"]),
                            tflops_fwd=_tflops(flops_fwd, ring_res["fwd_ms"]))
            ring_res["tflops_fwdbwd_per_gpu"] = round(ring_res["tflops_fwdbwd"] / world, 1)
            row["ring"] = ring_res
            row["exchange"] = bench_exchange(shape, args, device, world)
            if "single" in peers:
                single = bench_single(shape, full, args, device, ring_out)
                if single is not None:
                    single.update(tflops_fwdbwd=_tflops(flops, single["fwdbwd_ms"]),
                                  tflops_fwd=_tflops(flops_fwd, single["fwd_ms"]))
                    row["single_gpu"] = single
                    row["speedup_fwdbwd_vs_single"] = round(
                        single["fwdbwd_ms"] / ring_res["fwdbwd_ms"], 3)
            del ring_out
            for peer in peers:
                if not peer.startswith("torch-cp-"):
                    continue
                res = bench_torch_cp(shape, full, args, device, peer[len("torch-cp-"):])
                if "fwdbwd_ms" in res:
                    res.update(tflops_fwdbwd=_tflops(flops, res["fwdbwd_ms"]),
                               tflops_fwd=_tflops(flops_fwd, res["fwd_ms"]))
                row[peer] = res
            del full
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report["results"].append(row)
            if rank == 0:
                print_row(row, world)
    finally:
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_ring.json").write_text(json.dumps(report, indent=1, default=str))
            print(f"wrote {out / 'bench_ring.json'}")
        dist.destroy_process_group()


def print_row(row, world):
    print(f"\n{row['label']}  (world {world})")
    print(f"  {'who':<22} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>9} {'peak GiB':>9}")
    for key in ("ring", "single_gpu", "torch-cp-cudnn", "torch-cp-flash"):
        r = row.get(key)
        if r is None:
            continue
        if "error" in r:
            print(f"  {key:<22} cannot run: {r['error']}")
            continue
        print(f"  {key:<22} {r['fwd_ms']:9.1f} {r['fwdbwd_ms']:11.1f} {r['tflops_fwdbwd']:9.1f} "
              f"{str(r.get('peak_mem_gib')):>9}")
    if "speedup_fwdbwd_vs_single" in row:
        print(f"  ring vs one GPU (fwd+bwd): {row['speedup_fwdbwd_vs_single']}x; "
              f"max |out - out_single| = {row['single_gpu']['ring_out_max_abs_err_vs_single']:.3g}")
    for name, ex in row["exchange"].items():
        print(f"  one step's {name} exchange: {ex['bytes'] / 2**20:.0f} MiB in {ex['ms']} ms "
              f"({ex['gib_per_s']} GiB/s per direction)")
    for r, tot in enumerate(row["ring"]["profile"]["per_rank_totals"]):
        parts = ", ".join(f"{ph} " + " / ".join(f"{k[:-3]} {v:.1f}" for k, v in t.items()
                                                   if k.endswith("_ms"))
                          for ph, t in tot.items())
        print(f"  rank {r} ms: {parts}")


if __name__ == "__main__":
    sys.exit(main())
