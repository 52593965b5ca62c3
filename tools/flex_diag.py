"""Where a short-list BlockMask's time goes on the Hopper flex kernels (diagnostic, GPU only).

    python3 tools/flex_diag.py [--length 4096] [--batch 4] [--backward]

The same block lists run with the real mask_mod, with a cheap mask_mod (no gather), and with
every listed block made full (no mask_mod at all: timing only, the result is not the masked
attention), at 128- and 64-key tiles; the dense dedicated kernel and the portable flex kernels
beside them. TFLOP/s count the listed blocks (``solattn bench --suite flex``'s convention).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from toolkit import doc_ids  # tools/ is on sys.path when run as a script

from solattn import flash_attn_func
from solattn.bench.core import time_ms
from solattn.dispatch import forced_backend
from solattn.flex import create_block_mask, flex_attention
from solattn.flex import examples as ex
from solattn.flex.block_mask import _from_classes, block_classes
from solattn.kernels.hopper import flex_forward_plan

WINDOW = 1024


def with_mask(bm, mask_mod, L, all_full=False):
    """``bm``'s block classes with another mask_mod (and optionally every partial block full)."""
    classes = block_classes(bm.mask_mod, 1, 1, L, L, torch.device("cuda"), 128, 128)
    if all_full:
        classes = torch.where(classes == 1, 2, classes)
    return _from_classes(classes, mask_mod, (L, L), (128, 128))


@contextlib.contextmanager
def block_n(n):
    old = flex_forward_plan.first_block_ns
    flex_forward_plan.first_block_ns = (lambda d, fp: (n,)) if n else old
    flex_forward_plan._PLANS.clear()
    try:
        yield
    finally:
        flex_forward_plan.first_block_ns = old
        flex_forward_plan._PLANS.clear()


@contextlib.contextmanager
def portable():
    with forced_backend("portable"):
        yield


def listed(bm):
    return int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--masks", default="document,window")
    p.add_argument("--allow-spill", action="store_true",
                   help="run a Hopper build that spills in its loops (normally the plan falls "
                        "back to 64-key tiles or the portable kernel): timing only")
    a = p.parse_args()
    if a.allow_spill:
        flex_forward_plan.hot_spill_bytes = lambda kernel, allowed=0: 0
    B, H, L, D = a.batch, a.heads, a.length, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.backward:
        for t in (q, k, v):
            t.requires_grad_()
    do = torch.randn_like(q)
    ids = doc_ids(L, "cuda")

    def cheap(b, h, q_idx, kv_idx):  # no gather: the same compare count as the causal part
        return q_idx >= kv_idx

    masks = {"document": ex.document_causal(ids), "window": ex.sliding_window(WINDOW)}
    rows = []
    for name, mod in masks.items():
        if name not in a.masks.split(","):
            continue
        bm = create_block_mask(mod, None, None, L, L)
        blocks = listed(bm) * B * H
        fwd_flops = 4 * 128 * 128 * D * blocks
        variants = [(f"{name}: real mask_mod", bm, 0, None)]
        variants += [(f"{name}: real mask_mod, {n}-key", bm, n, None) for n in (128, 64)]
        variants += [(f"{name}: cheap mask_mod, {n}-key", with_mask(bm, cheap, L), n, None)
                     for n in (128, 64)]
        variants += [(f"{name}: all blocks full, {n}-key", with_mask(bm, cheap, L, True), n,
                      None) for n in (128, 64)]
        variants += [(f"{name}: real mask_mod, portable", bm, 0, "portable")]
        n_part = int(bm.kv_num_blocks.sum())
        print(f"# {name}: {listed(bm)} listed blocks per head ({n_part} partial)", flush=True)
        for label, mask, n, how in variants:
            ctx = portable() if how == "portable" else block_n(n)
            with ctx:
                def fwd(mask=mask):
                    return flex_attention(q, k, v, block_mask=mask)
                ms = time_ms(fwd)
                line = f"{label:<44} fwd {ms * 1e3:8.1f} us {fwd_flops / ms / 1e9:6.0f} TF/s"
                if a.backward:
                    out = fwd()

                    def bwd(out=out):
                        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    bms = time_ms(bwd)
                    line += f"  bwd {bms * 1e3:8.1f} us {2.5 * fwd_flops / bms / 1e9:6.0f} TF/s"
            print(line, flush=True)
            rows.append(line)
        if name == "window":
            qs, ks, vs = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v))
            ms = time_ms(lambda: flash_attn_func(qs, ks, vs, causal=True,
                                                 window_size=(WINDOW, 0)))
            print(f"{'window: dense flash_attn_func':<44} fwd {ms * 1e3:8.1f} us "
                  f"{fwd_flops / ms / 1e9:6.0f} TF/s (listed-block FLOPs)", flush=True)


if __name__ == "__main__":
    main()
