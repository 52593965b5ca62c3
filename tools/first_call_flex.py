"""A FlexAttention program's first call in a fresh process with an empty Triton cache: the
time a user waits before the first result (trace, code generation, kernel compiles, the run).

    python3 tools/first_call_flex.py --trees base=/tmp/base,new=. [--masks document,causal]

For each tree and mask (alternating trees), a new Python process on that tree with its own
empty ``TRITON_CACHE_DIR`` times ``flex_attention``'s first forward (synchronized), then the
first backward, then a second forward (warm, for scale). B4 H16 L4096 D128 bf16; the masks are
:func:`toolkit.catalogue`'s (16 causal documents: a short-list mask; causal). Results as
JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import json, sys, time, torch
sys.path.insert(0, {scripts!r})
from toolkit import catalogue
from solattn.flex import create_block_mask, flex_attention
L, B, H, D = 4096, 4, 16, 128
score_mod, mask_mod = catalogue(L, H, B, "cuda")[{mask!r}]
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
bm = create_block_mask(mask_mod, None, None, L, L, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
torch.cuda.synchronize()
t1 = time.perf_counter()
out.float().sum().backward()
torch.cuda.synchronize()
t2 = time.perf_counter()
flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
torch.cuda.synchronize()
t3 = time.perf_counter()
print("RESULT" + json.dumps(dict(fwd_s=t1 - t0, bwd_s=t2 - t1, warm_fwd_s=t3 - t2)))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="name=path,... (each a solattn checkout)")
    p.add_argument("--masks", default="document,causal")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    scripts = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for rnd in range(args.rounds):
        for mask in args.masks.split(","):
            for name, path in (trees if rnd % 2 == 0 else trees[::-1]):
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, TRITON_CACHE_DIR=cache,
                               PYTHONPATH=os.path.realpath(path))
                    proc = subprocess.run(
                        [sys.executable, "-c", WORKER.format(scripts=scripts, mask=mask)],
                        cwd=os.path.realpath(path), env=env, capture_output=True, text=True)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
                if not lines:
                    print(f"{name} {mask}: failed\n{proc.stderr[-2000:]}", flush=True)
                    continue
                row = dict(json.loads(lines[0][len("RESULT"):]), tree=name, mask=mask,
                           round=rnd)
                rows.append(row)
                print(f"round {rnd} {name:<6} {mask:<10} first forward {row['fwd_s']:.2f} s, "
                      f"first backward {row['bwd_s']:.2f} s (warm forward "
                      f"{row['warm_fwd_s'] * 1e3:.1f} ms)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "first_call_flex.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
