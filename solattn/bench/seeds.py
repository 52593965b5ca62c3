"""The seed documents' own measurements, per GPU: what ``solattn bench`` prints beside our rows on
such a GPU, and the rows docs/gpus.md builds its speed model on.

Peaks are the published dense 16-bit tensor-core rates with fp32 accumulation (what our kernels
and every FlashAttention use; the GeForce parts run fp16-accumulate MMAs at twice that rate).
TFLOP/s count 4 * B * H * Lq * Lk * D for a non-causal forward, as ``solattn bench`` does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeedRow:
    """One seed's reference measurements on one GPU."""

    cc: int             # compute capability (86 for sm_86)
    gpu: str            # the GPU the seed measured on
    match: str          # a word of torch.cuda.get_device_name that picks this row ("" = any)
    peak_tflops: float  # dense bf16/fp16 tensor peak, fp32 accumulate (published)
    bandwidth_gbs: float  # DRAM bandwidth (published)
    shape: str          # the seed's benchmark shape
    rows: tuple[tuple[str, str], ...]  # (kernel, measured TFLOP/s as printed in the seed)
    source: str         # the seed document and what it states
    note: str = ""


SEEDS: tuple[SeedRow, ...] = (
    SeedRow(86, "RTX 3090", "3090", 71.0, 936.0,
            "forward, d=128, non-causal, 16-bit (shape not stated)",
            (("FlashAttention 2 (the seed's reference)", "34.04"),
             ("the seed's first CUDA kernel", "16.83")),
            "seed 000 (Part 3 of a FlashAttention-in-CUDA series, RTX 3090)",
            "FA2 reaches 48% of the fp32-accumulate peak"),
    SeedRow(80, "A100 80GB SXM", "A100", 312.0, 2039.0,
            "forward, B1 H32 d128, seqlen 4096, fp16",
            (("FlashAttention 2", "0.9 ms (305 implied)"), ("cuDNN", "0.8 ms (344 implied)")),
            "seed 002 (tiled attention walkthrough, A100)",
            "the implied rates reach or pass the 312 peak (153 / 172 if the runs were causal, "
            "which the seed does not say): rough latencies, not a reference (FA2's own paper "
            "reports ~70% of peak on A100)"),
    SeedRow(120, "RTX 5060 Laptop", "5060", 26.8, 384.0,
            "forward, d=64, seqlen 1024: B4 H8 / B8 H16 / B64 H64",
            (("the seed's CUDA kernel (TMA, warp-specialized)", "29.8 / 30.6 / 31.45"),
             ("cuDNN", "41.2 / 48.1 / 51.14")),
            "seed 003 (FA2 for sm_120, RTX 5060 Laptop)",
            "26.8 is the fp32-accumulate peak at 2010 MHz (26 SMs); the seed's rows pass it, so "
            "they use fp16 accumulation (peak 53.5) or a higher clock: compare with care"),
    SeedRow(120, "RTX 5090", "", 209.5, 1792.0,
            "forward, B1 H8 Lq4096 Lk8192 d128, non-causal, bf16",
            (("the seed's CUDA kernel v5", "197.74 (94% of peak)"),
             ("cuDNN (F.sdpa)", "203.61"), ("flash-attn", "190.58")),
            "seed 001 (speed-of-light FlashAttention for the RTX 5090)"),
    SeedRow(100, "B200", "", 2250.0, 8000.0,
            "forward, bf16, the FA4 paper's sweep (d=128)",
            (("FlashAttention-4 (paper, best shape)", "1613 (71% of peak)"),),
            "seed 004 describes FA4's sm_100 forward without timings; the number is the FA4 "
            "paper's (2026)"),
)


def seed_rows(cc: int, device_name: str = "") -> list[SeedRow]:
    """The seed rows of a GPU of capability ``cc`` named ``device_name``: the rows whose ``match``
    word is in the name, else the capability's catch-all row(s)."""
    rows = [r for r in SEEDS if r.cc == cc]
    named = [r for r in rows if r.match and r.match in device_name]
    return named or [r for r in rows if not r.match] or rows


def reference_lines(cc: int, device_name: str = "") -> list[str]:
    """Lines ``solattn bench`` prints under its header on such a GPU (none for other parts)."""
    out = []
    for r in seed_rows(cc, device_name):
        kernels = "; ".join(f"{name} {value}" for name, value in r.rows)
        out.append(f"seed reference ({r.gpu}, sm_{r.cc}; peak {r.peak_tflops:g} TFLOP/s bf16, "
                   f"{r.bandwidth_gbs:g} GB/s): {r.shape}: {kernels} [{r.source}]")
        if r.note:
            out.append(f"  note: {r.note}")
    return out
