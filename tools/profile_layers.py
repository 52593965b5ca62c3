"""cProfile of ``flash_attn_func`` forward + backward over N layers' tensors (as
``host_layers.py`` runs them; the backward on the main thread so that cProfile sees it).

    python3 tools/profile_layers.py [--layers 22] [--steps 100] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from solattn import flash_attn_func


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    B, L, H, D = 1, 128, 8, 64
    xs = [[torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3)] for _ in range(args.layers)]

    def step():
        outs = [flash_attn_func(q, k, v, causal=True) for q, k, v in xs]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    torch.autograd.set_multithreading_enabled(False)
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"per layer and step: divide by {args.steps * args.layers}")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
