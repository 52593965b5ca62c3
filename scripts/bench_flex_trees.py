"""solattn.flex forward and backward of several source trees on the same GPU, in alternating
rounds (one worker process per tree and round): a same-run A/B of a kernel change.

    python3 scripts/bench_flex_trees.py --trees base=/tmp/base,new=. --mods causal,document
    python3 scripts/bench_flex_trees.py --trees new=. --fwd-block-n 64,128   # key tile, forward

TFLOP/s count the listed blocks' FLOPs (bench_flex.py's convention: 4 B H L^2 d x block density
forward, 2.5x that backward); times are ``triton.testing.do_bench`` medians after a warm-up.
``--fwd-block-n`` makes each tree also run with the Hopper flex forward's key tile forced
(``flex_forward.first_block_ns``) -- a variant per value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKER = r"""
import json, sys, torch, triton
sys.path.insert(0, {scripts!r})
from bench_flex import catalogue
from solattn.flex import create_block_mask, flex_attention
from solattn.kernels.hopper import flex_forward
block_n = {block_n!r}
if block_n:
    flex_forward.first_block_ns = lambda head_dim, fp: (block_n,)
out = []
for L in {lengths!r}:
    B, H, D = max(1, {tokens} // L), {heads}, {dim}
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for name, (score_mod, mask_mod) in catalogue(L, H, B, "cuda").items():
        if name not in {mods!r}:
            continue
        bm = create_block_mask(mask_mod, B if name == "prefix_lm" else None, None, L, L,
                               device="cuda")
        flops = 4 * B * H * L * L * D * (1 - bm.sparsity() / 100)
        run = lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        o = run()
        for _ in range(3):
            triton.testing.do_bench(run, warmup=50, rep=100)
        fwd = triton.testing.do_bench(run, warmup=100, rep=400)
        bwd = triton.testing.do_bench(
            lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup=50,
            rep=400)
        out.append(dict(L=L, mod=name, fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9,
                        bwd_tflops=2.5 * flops / bwd / 1e9))
print("RESULT" + json.dumps(out))
"""


def run_worker(code: str, path: str, name: str):
    """Run a worker's ``code`` in a fresh process on the solattn tree at ``path`` -> the list
    it printed after ``RESULT``, or None (its stderr's tail printed) when it failed."""
    root = os.path.realpath(path)
    # The worker runs in the tree's directory: `python -c` puts its working directory first on
    # sys.path, ahead of PYTHONPATH, so from any other directory holding a solattn package (the
    # repository root) every tree would import that one. The guard fails the worker otherwise.
    guard = ("import os as _os, solattn as _s\n"
             f"assert _os.path.realpath(_s.__file__).startswith({root!r} + _os.sep), _s.__file__\n")
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", guard + code], env=env, capture_output=True,
                          text=True, cwd=root)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        print(f"{name} failed:\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(line[len("RESULT"):])


def write_results(out_dir: str, filename: str, results: list) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, filename), "w") as f:
        json.dump(results, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="name=path,... (each a solattn checkout)")
    p.add_argument("--mods", default="causal,sliding_window,document")
    p.add_argument("--lengths", default="4096")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // L")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fwd-block-n", default="", help="comma-separated key tiles to force")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    block_ns = [int(x) for x in args.fwd_block_n.split(",") if x] or [None]
    lengths = [int(x) for x in args.lengths.split(",")]
    mods = args.mods.split(",")
    scripts = os.path.dirname(os.path.abspath(__file__))
    results = []
    for rnd in range(args.rounds):
        for name, path in trees:
            for block_n in block_ns:
                code = WORKER.format(scripts=scripts, block_n=block_n, lengths=lengths,
                                     tokens=args.tokens, heads=args.heads, dim=args.dim,
                                     mods=mods)
                rows = run_worker(code, path, name)
                tag = name + (f" bn{block_n}" if block_n else "")
                for r in rows or ():
                    r.update(tree=tag, round=rnd)
                    results.append(r)
                    print(f"round {rnd} {tag:<14} L={r['L']:<6} {r['mod']:<15} fwd "
                          f"{r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TF/s)  bwd "
                          f"{r['bwd_ms']:.3f} ms ({r['bwd_tflops']:.0f})", flush=True)
    write_results(args.out, "bench_flex_trees.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
