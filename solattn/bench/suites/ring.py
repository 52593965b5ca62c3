"""``ring`` (under ``torchrun``): ring attention (``solattn.distributed``) forward + backward
across the ranks' GPUs, against one GPU running flash_attn_func on the whole sequence and
against torch's context parallelism (SDPA's cuDNN and FLASH backends) on the same ranks.

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


_MESH: dict = {}


def _torch_cp(q, k, v, do, backend_name: str, rounds: int, device) -> list:
    """torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
    around SDPA with the ``backend_name`` backend, ``enable_gqa``: forward + backward ms per
    round (the slowest rank's). Raises when this torch or backend cannot run it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh(device, (dist.get_world_size(),))
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))  # (b, h, s, d)
    bufs = [qt, kt, vt, dot]
    with context_parallel(_MESH["mesh"], buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers=set(bufs)):
        ql, kl, vl = (t.detach().requires_grad_() for t in (qt, kt, vt))

        def step():
            with sdpa_kernel([backend]):
                o = torch.nn.functional.scaled_dot_product_attention(
                    ql, kl, vl, is_causal=True, enable_gqa=kl.shape[1] != ql.shape[1])
            torch.autograd.grad(o, (ql, kl, vl), dot)

        step()
        return [_wall(step, device) for _ in range(rounds)]


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
    owned = not dist.is_initialized()
    if owned:
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
        torch_cp = {}
        for backend_name in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            try:
                torch_cp[backend_name] = _torch_cp(q, k, v, do, backend_name, ctx.rounds, device)
            except Exception as exc:  # noqa: BLE001 - this torch cannot: say why, go on
                torch_cp[backend_name] = f"{type(exc).__name__}: {str(exc)[:120]}"
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
        for backend_name, cp in torch_cp.items():
            peer = f"torch-cp-{'cudnn' if backend_name.startswith('CUDNN') else 'flash'}"
            if isinstance(cp, str):
                res.add(make_record("fwdbwd", peer, shape, note=cp))
                line += f" {peer}: {cp} |"
                continue
            ms_cp = statistics.median(cp)
            res.add(make_record("fwdbwd", peer, shape, ms=ms_cp, value=flops / ms_cp / 1e9,
                                rounds=cp))
            line += f" {peer}: {flops / ms_cp / 1e9:.0f} TFLOP/s (ring {ms_cp / ms:.2f}x) |"
        out(line)
    if owned:
        dist.destroy_process_group()
    return summary
