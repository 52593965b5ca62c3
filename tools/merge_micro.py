"""Time the split merge alone (diagnostic, GPU only): one program per kv head merges ``S``
fp32 partials of 4 packed rows x 128, as the fused decode's last split does.

    python3 tools/merge_micro.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from solattn.kernels.triton.combine import merge_finish, merge_parts


@triton.jit
def merge_step(m, total, acc, l_s, o_ptrs, o_mask, CM: tl.constexpr):
    """The merge a part at a time (solattn's before merge_parts): the baseline."""
    o_s = tl.load(o_ptrs, mask=o_mask, other=0.0, cache_modifier=CM).to(tl.float32)
    m_new = tl.maximum(m, l_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    w = tl.exp(l_s - m_use)
    acc = acc * alpha[:, None] + tl.where((w > 0.0)[:, None], w[:, None] * o_s, 0.0)
    return m_new, total * alpha + w, acc


@triton.jit
def merge_old(O, L, OUT, S, BLOCK_M: tl.constexpr, D: tl.constexpr, CM: tl.constexpr,
              UNROLL: tl.constexpr):
    h = tl.program_id(0)
    r = tl.arange(0, BLOCK_M)
    ok = r < 4
    d = tl.arange(0, D)
    l_row = L + h * 4 + r
    o_row = O + (h * 4 + r) * D
    stride_l = tl.num_programs(0) * 4
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for s in tl.range(0, S, loop_unroll_factor=UNROLL):
        l_s = tl.load(l_row + s * stride_l, mask=ok, other=float("-inf"), cache_modifier=CM)
        m, total, acc = merge_step(m, total, acc, l_s,
                                   o_row[:, None] + s * stride_l * D + d[None, :],
                                   ok[:, None], CM)
    out, lse = merge_finish(m, total, acc)
    tl.store(OUT + (h * 4 + r)[:, None] * D + d[None, :], out, mask=ok[:, None])


@triton.jit
def merge_new(O, L, OUT, S, D: tl.constexpr, CM: tl.constexpr, PARTS: tl.constexpr):
    h = tl.program_id(0)
    r = tl.arange(0, 4)
    d = tl.arange(0, D)
    stride_l = tl.num_programs(0) * 4
    out, lse = merge_parts(O + (h * 4 + r) * D, L + h * 4 + r, r < 4, d, d < D,
                           stride_l * D, stride_l, 1, S, 4, D, PARTS, CM)
    tl.store(OUT + (h * 4 + r)[:, None] * D + d[None, :], out)


def main():
    H, D = 8, 128
    for S in (16, 32, 64, 128):
        o = torch.randn(S, H * 4, D, device="cuda")
        lse = torch.randn(S, H * 4, device="cuda")
        out = torch.empty(H * 4, D, device="cuda")
        ref = None
        runs = {}
        for rows in (16,):
            for unroll in (4,):
                runs[f"step unroll{unroll} [{rows},{D}]"] = (
                    lambda rows=rows, unroll=unroll: merge_old[(H,)](o, lse, out, S, rows, D,
                                                                     ".cg", unroll))
        for parts in (8, 16, 32):
            runs[f"merge_parts, {parts} parts a step"] = (
                lambda parts=parts: merge_new[(H,)](o, lse, out, S, D, ".cg", parts))
        for name, fn in runs.items():
            fn()
            if ref is None:
                ref = out.clone()
            err = (out - ref).abs().max().item()
            us = do_bench_cudagraph(fn, rep=50) * 1e3
            print(f"S{S:<4} {name:<28} {us:7.2f} us  (max diff {err:.1e})", flush=True)
        empty = torch.empty(1, device="cuda")
        us = do_bench_cudagraph(lambda: empty.zero_(), rep=50) * 1e3
        print(f"S{S:<4} {'an empty launch (zero_)':<28} {us:7.2f} us", flush=True)


if __name__ == "__main__":
    main()
