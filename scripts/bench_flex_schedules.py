"""The Hopper flex backward's tile schedules, timed in one process on the same inputs.

For each mask of ``bench_flex.py``'s catalogue and each length: solattn's flex backward with
every schedule of ``solattn.kernels.hopper.flex_backward.SCHEDULES`` (one CTA per tile;
persistent CTAs dealt round robin; persistent CTAs claiming tiles from a counter) and torch's
compiled flex backward, in ``--passes`` alternating passes (the schedules' order rotates each
pass). Checks dK / dV bitwise equal across schedules. TFLOP/s over the listed blocks, FLOPs = 2.5
x the forward's, ``do_bench`` medians after a warm-up.

    python scripts/bench_flex_schedules.py --lengths 4096,16384 --mods causal,document
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_flex import catalogue  # noqa: E402 - the script's own directory

from solattn.flex import create_block_mask, flex_attention  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // L")
    p.add_argument("--mods", default="causal,sliding_window,document,prefix_lm,alibi,softcap")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--no-torch", action="store_true", help="skip torch's compiled flex")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_flex_schedules_out"))
    args = p.parse_args(argv)
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex
    from triton.testing import do_bench

    from solattn.bench.core import env_info, header_lines
    from solattn.flex import ops
    from solattn.kernels.hopper import flex_backward as hfb

    ops.HOPPER_BWD_BY_DEFAULT = True
    torch._dynamo.config.specialize_float = True
    torch._functorch.config.donated_buffer = False
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    torch_flex_c = torch.compile(torch_flex, dynamic=False)
    info = env_info()
    lines = header_lines(info)
    rows = []
    schedules = list(hfb.SCHEDULES)
    for L in [int(x) for x in args.lengths.split(",")]:
        B = max(1, args.tokens // L)
        H, D = args.heads, args.dim
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for name, (score_mod, mask_mod) in catalogue(L, H, B, "cuda").items():
            if name not in args.mods.split(","):
                continue
            bb = B if name == "prefix_lm" else None
            bm = create_block_mask(mask_mod, bb, None, L, L, device="cuda")
            flops = 2.5 * 4 * B * H * L * L * D * (1 - bm.sparsity() / 100)
            runs, grads = {}, {}
            for s in schedules:
                hfb.SCHEDULE = s
                out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
                grads[s] = torch.autograd.grad(out, [q, k, v], dout, retain_graph=True)
                runs[s] = (lambda out=out: torch.autograd.grad(out, [q, k, v], dout,
                                                               retain_graph=True))
            if not args.no_torch:
                tbm = torch_cbm(mask_mod, bb, None, L, L, device="cuda")
                out = torch_flex_c(q, k, v, score_mod=score_mod, block_mask=tbm)
                runs["torch"] = (lambda out=out: torch.autograd.grad(out, [q, k, v], dout,
                                                                     retain_graph=True))
            same = {s: bool(torch.equal(grads[s][1], grads["tile"][1])
                            and torch.equal(grads[s][2], grads["tile"][2])) for s in schedules}
            times = {n: [] for n in runs}
            names = list(runs)
            for i in range(args.passes):
                for n in names[i % len(names):] + names[:i % len(names)]:
                    hfb.SCHEDULE = n if n in schedules else hfb.SCHEDULE
                    runs[n]()  # warm (clock ramp)
                    times[n].append(do_bench(runs[n], warmup=25, rep=100))
            tf = {n: [round(flops / t / 1e9, 1) for t in ts] for n, ts in times.items()}
            row = {"L": L, "B": B, "H": H, "D": D, "mod": name, "tflops": tf,
                   "dkdv_bitwise_equal": same}
            rows.append(row)
            line = (f"L={L:<6} {name:<15} " + "  ".join(
                f"{n} {'/'.join(f'{x:.0f}' for x in v)}" for n, v in tf.items())
                + f"  dK/dV equal {all(same.values())}")
            print(line, flush=True)
            lines.append(line)
    hfb.SCHEDULE = "dynamic"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_flex_schedules.json"), "w") as f:
        json.dump({"argv": " ".join(sys.argv), "info": info, "rows": rows}, f, indent=1,
                  default=str)
    with open(os.path.join(args.out, "bench_flex_schedules.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
