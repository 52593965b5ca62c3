"""Benchmark core: shapes, one FLOP counter, the timing protocol, the speed-of-light denominator.

Conventions (used for every number in BENCHMARKS.md):
* FLOPs of a forward = ``4 * b * h * s_q * s_k * d`` (two matmuls), halved for causal; backward
  counts 2.5x the forward (five matmuls instead of two).
* Time = ``triton.testing.do_bench`` median (warm-up and repetitions in ms), same inputs and same
  protocol for every peer.
* Speed of light = a bf16 8192^3 ``torch.matmul`` measured in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Shape:
    """One attention problem, flash-attn layout ``(b, s, h, d)``."""

    b: int
    h: int
    s_q: int
    s_k: int
    d: int
    causal: bool = False
    h_kv: int | None = None
    d_v: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.h_kv or self.h

    @property
    def dv(self) -> int:
        return self.d_v or self.d

    def label(self) -> str:
        kv = f" Hkv{self.h_kv}" if self.h_kv else ""
        sq = f"L{self.s_q}" if self.s_q == self.s_k else f"Lq{self.s_q} Lk{self.s_k}"
        dv = f"/{self.d_v}" if self.d_v else ""
        return f"B{self.b} H{self.h}{kv} {sq} D{self.d}{dv}{' causal' if self.causal else ''}"


def attn_flops(shape: Shape, backward: bool = False) -> float:
    """The conventional FLOP count (see module docstring)."""
    f = 2.0 * shape.b * shape.h * shape.s_q * shape.s_k * (shape.d + shape.dv)
    if shape.causal:
        f /= 2
    return f * 2.5 if backward else f


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    extra: dict = field(default_factory=dict)


def make_inputs(shape: Shape, dtype=torch.bfloat16, device="cuda", requires_grad=False) -> Inputs:
    """Random normal inputs (never zeros: they run faster than real data)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s):
        t = torch.randn(*s, generator=g, device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return Inputs(
        rnd(shape.b, shape.s_q, shape.h, shape.d),
        rnd(shape.b, shape.s_k, shape.kv_heads, shape.d),
        rnd(shape.b, shape.s_k, shape.kv_heads, shape.dv),
    )


def time_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` with CUDA events (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """The run's speed of light: a bf16 n^3 matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def copy_gbps(nbytes: int = 2 << 30) -> float:
    """HBM ceiling: a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def read_gbps(nbytes: int = 1 << 30) -> float:
    """HBM read ceiling: a reduction over ``nbytes`` (bytes read only; what decode does)."""
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    ms = time_graph_ms(lambda: x.sum(dtype=torch.float32))
    return nbytes / ms / 1e6


def time_graph_ms(fn) -> float:
    """Median ms of CUDA-graph replays (for microsecond-scale launches such as a decode step)."""
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=60, return_mode="median"))
