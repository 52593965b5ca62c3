"""Peak extra GPU memory and time of one forward+backward, per backward kernel.

    python tools/memory_peak.py [--seqlen 65536] [--heads 16] [--dim 128]

Runs the same causal bf16 call (batch 1) twice in fresh processes, once with the default
dispatch and once with ``SOLATTN_BACKEND=portable``, and prints for each: the peak memory
allocated above the inputs (q, k, v and the output gradient) during forward+backward, and the
median time of forward+backward (``triton.testing.do_bench``, after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _child(seqlen: int, heads: int, dim: int) -> dict:
    import torch
    import triton

    import solattn

    torch.manual_seed(0)
    shape = (1, seqlen, heads, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = solattn.flash_attn_func(q, k, v, causal=True)
        out.backward(do)
        q.grad = k.grad = v.grad = None

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = triton.testing.do_bench(step, warmup=200, rep=1000, return_mode="median")
    flops = 4 * heads * seqlen * seqlen * dim / 2 * 3.5
    return {"peak_mib": peak / 2**20, "ms": ms, "tflops": flops / ms / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.seqlen, a.heads, a.dim)))
        return 0
    print(f"B1 H{a.heads} L{a.seqlen} d{a.dim} causal bf16, forward+backward")
    for name, backend in (("default", None), ("portable", "portable")):
        env = dict(os.environ)
        env.pop("SOLATTN_BACKEND", None)
        if backend:
            env["SOLATTN_BACKEND"] = backend
        out = subprocess.run([sys.executable, __file__, "--child", f"--seqlen={a.seqlen}",
                              f"--heads={a.heads}", f"--dim={a.dim}"], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{name:>9}: failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:>9}: peak extra {r['peak_mib']:7.0f} MiB   {r['ms']:8.2f} ms "
              f"  {r['tflops']:6.0f} TFLOP/s (fwd+bwd)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
