"""The Hopper flex forward with full-block and half-block CTAs on the same calls (the
``flex_forward.HALF_CTA_MAX_BLOCKS`` rule forced either way), over causal document masks of
several document counts: where the rule's threshold should sit.

    python3 scripts/bench_half_cta.py [--lengths 4096,16384] [--docs 2,4,8,16,32] [--rounds 2]

Per row: the BlockMask's listed key blocks a query block (``FlexParams.mean_kv_blocks``'s
value), and the forward's ``triton.testing.do_bench`` median (ms) with each kernel, alternating
which runs first in each round; B = 16384 // L, H16, D128, bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_flex import _doc_ids  # noqa: E402

from solattn.flex import block_mask as bm_lib  # noqa: E402
from solattn.flex import create_block_mask, examples, flex_attention  # noqa: E402
from solattn.kernels.hopper import flex_forward  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--docs", default="2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        B, H, D = max(1, 16384 // L), 16, 128
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for n_docs in (int(x) for x in args.docs.split(",")):
            mask_mod = examples.document_causal(_doc_ids(L, "cuda", n_docs))
            bm = create_block_mask(mask_mod, None, None, L, L, device="cuda")
            mean = bm_lib.kernel_lists(bm, B, H, L, L).mean_kv_blocks()
            run = lambda: flex_attention(q, k, v, block_mask=bm)  # noqa: E731
            times = {"full": [], "half": []}
            for rnd in range(args.rounds):
                order = ("full", "half") if rnd % 2 == 0 else ("half", "full")
                for kind in order:
                    flex_forward.HALF_CTA_MAX_BLOCKS = 1e9 if kind == "half" else -1
                    for _ in range(3):  # warm-up (the clock ramp)
                        triton.testing.do_bench(run, warmup=50, rep=100)
                    times[kind].append(triton.testing.do_bench(run, warmup=100, rep=400))
            row = dict(L=L, docs=n_docs, mean_blocks=mean, **times)
            rows.append(row)
            print(f"L={L:<6} docs={n_docs:<3} listed blocks/query block {mean:5.1f}  full "
                  f"{' '.join(f'{t:.3f}' for t in times['full'])} ms  half "
                  f"{' '.join(f'{t:.3f}' for t in times['half'])} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_half_cta.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
