"""Benchmark core: shapes, one FLOP counter, the timing protocol, the speed-of-light denominator,
the tolerance rule of the bench's verification, and the run's environment header.

Conventions (used for every number in BENCHMARKS.md):
* FLOPs of a forward = ``4 * b * h * s_q * s_k * d`` (two matmuls; ``2 * (d + d_v)`` per score
  when ``d_v != d``), halved for causal; the backward counts 2.5x the forward (five matmuls
  instead of two), forward + backward 3.5x (:data:`FLOP_FACTOR`).
* Time = ``triton.testing.do_bench`` median, after a warm-up that brings the GPU's clocks up
  (:func:`time_ms`); same inputs and same protocol for every peer.
* Speed of light (SOL) = a bf16 8192^3 ``torch.matmul`` measured in the same run.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

DIRECTIONS = ("fwd", "bwd", "fwdbwd")
# Matmuls per direction, in units of the forward's two: backward 5 (dV, dP, dS->dQ, dS->dK plus
# the recomputed S), forward + backward 7.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


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

    def as_dict(self) -> dict:
        return dict(b=self.b, h=self.h, h_kv=self.kv_heads, s_q=self.s_q, s_k=self.s_k,
                    d=self.d, d_v=self.dv, causal=self.causal)


def attn_flops(shape: Shape, backward: bool = False, *, direction: str | None = None) -> float:
    """The conventional FLOP count (see module docstring). ``direction`` is one of
    :data:`DIRECTIONS`; ``backward=True`` is ``direction="bwd"``."""
    direction = direction or ("bwd" if backward else "fwd")
    f = 2.0 * shape.b * shape.h * shape.s_q * shape.s_k * (shape.d + shape.dv)
    if shape.causal:
        f /= 2
    return f * FLOP_FACTOR[direction]


def visible_pairs(n_q: int, n_k: int, causal: bool = False,
                  window: tuple[int, int] | None = None) -> int:
    """Query-key pairs a call of ``n_q`` queries and ``n_k`` keys computes: all of them, or
    those a causal mask and a sliding window ``(left, right)`` (-1: unbounded) keep, aligned
    bottom-right as flash-attn's (query ``i`` at key position ``i + n_k - n_q``; causal: ``right
    = 0``). The count of :func:`solattn.reference.allowed_mask`, per row: the work of masked
    rows (varlen sequences, windows) where :func:`attn_flops`' halving does not apply."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return n_q * n_k
    pos = torch.arange(n_q, dtype=torch.int64) + (n_k - n_q)
    hi = torch.full_like(pos, n_k - 1) if right < 0 else (pos + right).clamp(max=n_k - 1)
    lo = torch.zeros_like(pos) if left < 0 else (pos - left).clamp(min=0)
    return int((hi - lo + 1).clamp(min=0).sum())


def shape_matches(shape: Shape, patterns: str | None) -> bool:
    """``--shapes`` filter: comma-separated alternatives, each a space-separated list of label
    tokens that must all appear (``"D128 causal,D64"``: causal D128 shapes, and every D64 one).
    ``full`` matches the shapes that are not causal."""
    if not patterns:
        return True
    tokens = set(shape.label().split()) | ({"causal"} if shape.causal else {"full"})
    return any(set(alt.split()) <= tokens for alt in patterns.split(",") if alt.strip())


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


def direction_fn(attn, x: Inputs, direction: str):
    """A no-argument callable that runs ``attn(q, k, v)`` in ``direction`` on ``x``'s tensors:
    ``fwd`` under ``no_grad``; ``bwd`` the gradients of one recorded forward (``retain_graph``);
    ``fwdbwd`` a forward and its gradients. ``bwd`` runs one forward now (the compile)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    if direction == "fwd":
        q, k, v = (t.detach() for t in (x.q, x.k, x.v))

        def run():
            with torch.no_grad():
                return attn(q, k, v)

        return run
    q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))
    g = torch.Generator(device=q.device).manual_seed(1)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=g, device=q.device, dtype=q.dtype)
    if direction == "bwd":
        out = attn(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)


# ---- timing ---------------------------------------------------------------------------------

# On an H100 the first do_bench right after a compile (seconds of idle GPU) read 15-46% low:
# the SM clock had dropped. The warm-up runs the timed function for HEAT_S first; when the GPU
# was busy a moment ago (back-to-back timings of one table) a shorter one keeps clocks up.
HEAT_S = 0.2
HEAT_BUSY_S = 0.05
IDLE_GAP_S = 1.0
_last_busy = [0.0]

# Before the first timing of a run the GPU is brought to its clocks (:func:`settle_clocks`): an
# H100 idle at 345 MHz read the first anchor rows of `make bench` up to 14% low (issue 40).
SETTLE_BURST_S = 0.2
SETTLE_TOLERANCE = 0.01
SETTLE_MAX_S = 10.0
# Timings are R interleaved rounds (every peer of a row once per round); a row whose rounds
# spread (max - min over the median) more than SPREAD_FLAG is flagged in the tables.
ROUNDS = 5
SPREAD_FLAG = 0.03


def warm_up(fn, seconds: float = HEAT_S) -> None:
    """Run ``fn`` back to back for about ``seconds`` of GPU time (synchronizing every ~20 ms of
    work, so a microsecond kernel does not queue millions of launches)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    batch = max(1, min(1000, int(0.02 / one)))
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()


def time_ms(fn, warmup: int = 25, rep: int = 100, heat_s: float | None = None) -> float:
    """Median milliseconds of ``fn()`` with CUDA events (``triton.testing.do_bench``), after
    :func:`warm_up` (``heat_s`` seconds; default :data:`HEAT_S` after an idle gap, else
    :data:`HEAT_BUSY_S`)."""
    from triton.testing import do_bench

    if heat_s is None:
        idle = time.perf_counter() - _last_busy[0] > IDLE_GAP_S
        heat_s = HEAT_S if idle else HEAT_BUSY_S
    warm_up(fn, heat_s)
    ms = float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    _last_busy[0] = time.perf_counter()
    return ms


def settle_clocks(n: int = 4096, burst_s: float = SETTLE_BURST_S,
                  tolerance: float = SETTLE_TOLERANCE, max_s: float = SETTLE_MAX_S) -> dict:
    """Bring the GPU to its clocks: bursts of bf16 ``n``^3 matmuls of about ``burst_s`` each,
    timed with CUDA events, until two consecutive bursts' rates agree within ``tolerance``
    (relative) or ``max_s`` seconds have passed. Returns ``{"rates": [TFLOP/s per burst],
    "settled": bool, "seconds": float}``."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * n**3
    t0 = time.perf_counter()
    a @ b
    torch.cuda.synchronize()
    per_call = max(time.perf_counter() - t0, 1e-5)
    reps = max(1, int(burst_s / per_call))
    rates: list[float] = []
    settled = False
    while time.perf_counter() - t0 < max_s:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        rates.append(flops * reps / ms / 1e9)
        # the first bursts were sized on a cold clock: keep each near burst_s
        reps = max(1, int(reps * burst_s * 1e3 / max(ms, 1e-3)))
        if len(rates) >= 2 and abs(rates[-1] - rates[-2]) <= tolerance * rates[-2]:
            settled = True
            break
    _last_busy[0] = time.perf_counter()
    return {"rates": rates, "settled": settled, "seconds": time.perf_counter() - t0}


@dataclass
class Timing:
    """One peer's time on one row: the median of its rounds and their spread."""

    rounds: list = field(default_factory=list)
    note: str | None = None

    @property
    def ms(self) -> float | None:
        return statistics.median(self.rounds) if self.rounds else None

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the rounds; None with fewer than two."""
        if len(self.rounds) < 2:
            return None
        return (max(self.rounds) - min(self.rounds)) / self.ms

    @property
    def flagged(self) -> bool:
        return self.spread is not None and self.spread > SPREAD_FLAG


def time_rounds(fns: dict, rounds: int = ROUNDS, timer=None) -> dict:
    """``{name: Timing}`` of the no-argument callables ``fns``: ``rounds`` rounds, each timing
    every callable once with ``timer`` (default :func:`time_ms`), the order rotated by one each
    round so that no callable always follows the same one. A callable that raises stops being
    timed; its :class:`Timing` keeps the rounds it had and says why in ``note``."""
    timer = timer or time_ms
    names = list(fns)
    out = {n: Timing() for n in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            t = out[name]
            if t.note is not None:
                continue
            try:
                t.rounds.append(float(timer(fns[name])))
            except Exception as exc:  # noqa: BLE001 - an out-of-memory or a launch failure
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                t.note = short_error(exc)
    return out


def time_cpu_ms(fn, reps: int = 3) -> float:
    """Wall-clock median of ``fn()`` on the CPU (Triton's interpreter): exercises the benchmark's
    plumbing without a GPU; such numbers say nothing about kernel speed."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def time_graph_ms(fn) -> float:
    """Median ms of CUDA-graph replays (for microsecond-scale launches such as a decode step)."""
    from triton.testing import do_bench_cudagraph

    warm_up(fn, HEAT_S)
    ms = float(do_bench_cudagraph(fn, rep=60, return_mode="median"))
    _last_busy[0] = time.perf_counter()
    return ms


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """The run's speed of light: a bf16 n^3 matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b, heat_s=HEAT_S)
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


def call_memory_bytes(fn) -> int:
    """Peak bytes allocated by one call of ``fn`` beyond what was allocated before it (its output
    included): the naive implementation's materialized score matrix shows up here."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


# ---- verification ---------------------------------------------------------------------------


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; NaN anywhere counts as infinite error."""
    d = (a.double() - b.double()).abs()
    if torch.isnan(d).any():
        return math.inf
    return d.max().item() if d.numel() else 0.0


def tolerance(out, ref_hi, ref_lo, factor: float = 2.0, eps: float = 1e-5):
    """flash-attn's rule (the test suite's ``tests/oracle.py``): ``|out - ref| <= factor *
    |ref_lowp - ref| + eps``, max abs errors, ``ref_hi`` the float64 oracle and ``ref_lo`` the
    same computation by PyTorch in the input dtype. Returns ``(ok, err, bound)``."""
    err = max_abs_err(out, ref_hi) if out.shape == ref_hi.shape else math.inf
    bound = factor * max_abs_err(ref_lo, ref_hi) + eps
    return err <= bound, err, bound


# ---- environment ----------------------------------------------------------------------------


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _nvidia_smi(props) -> dict:
    """Driver, clocks, power limit and temperature of the device (nvidia-smi; {} without it)."""
    query = "driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu"
    target = ["-i", "0"]
    try:
        target = ["-i", f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:"
                        f"{props.pci_device_id:02X}.0"]
    except AttributeError:
        pass
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                              *target], capture_output=True, text=True, timeout=15)
        vals = [v.strip() for v in res.stdout.strip().splitlines()[0].split(",")]
    except Exception:  # noqa: BLE001 - no nvidia-smi, a timeout, an odd output: header says so
        return {}
    keys = ("driver", "sm_clock_mhz", "max_sm_clock_mhz", "power_limit_w", "temperature_c")
    return dict(zip(keys, vals))


def gpu_clocks() -> dict:
    """The SM clock now (nvidia-smi; else ``torch.cuda.clock_rate``, which needs pynvml), e.g.
    right before or after a measurement; {} without a GPU or either source."""
    if not torch.cuda.is_available():
        return {}
    info = _nvidia_smi(torch.cuda.get_device_properties(0))
    out = {k: info[k] for k in ("sm_clock_mhz", "max_sm_clock_mhz") if k in info}
    if "sm_clock_mhz" not in out:
        try:
            out["sm_clock_mhz"] = str(torch.cuda.clock_rate(0))
        except Exception:  # noqa: BLE001 - no pynvml: the header says the clock is unknown
            pass
    return out


def clock_line(clocks: dict, when: str) -> str:
    """``SM clock 1980 MHz (max 1980) before the warm-up``, or that it is unknown."""
    if not clocks.get("sm_clock_mhz"):
        return f"SM clock {when}: unknown (no nvidia-smi or pynvml)"
    top = f" (max {clocks['max_sm_clock_mhz']})" if clocks.get("max_sm_clock_mhz") else ""
    return f"SM clock {when}: {clocks['sm_clock_mhz']} MHz{top}"


def env_info() -> dict:
    """Device, driver, versions, clocks, date and command line of this run."""
    import triton

    import solattn

    info = {"torch": torch.__version__, "triton": triton.__version__,
            "solattn": solattn.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": " ".join(sys.argv)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"sm_{props.major}{props.minor}",
                    sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
        info.update(_nvidia_smi(props))
        info["timer"] = "triton.testing.do_bench median (CUDA events)"
    else:
        info["device"] = "cpu (Triton interpreter)" if interpreting() else "cpu"
        info["timer"] = "CPU wall clock in Triton's interpreter: not a kernel measurement"
    return info


def header_lines(info: dict) -> list[str]:
    """The run's header, for humans (the JSON keeps ``info`` itself)."""
    dev = info.get("device", "?")
    if "capability" in info:
        dev += (f" ({info['capability']}, {info['sms']} SMs, {info['memory_gib']} GiB), driver "
                f"{info.get('driver', '?')}, CUDA {info.get('cuda')}")
    lines = [f"device: {dev}",
             f"versions: torch {info['torch']}, triton {info['triton']}, solattn {info['solattn']},"
             f" python {info['python']}; {info['date']}"]
    if "sm_clock_mhz" in info:
        lines.append(f"SM clock {info['sm_clock_mhz']} MHz (max {info.get('max_sm_clock_mhz')}), "
                     f"power limit {info.get('power_limit_w')} W, {info.get('temperature_c')} C "
                     "(idle, before the warm-up)")
    lines.append(f"timer: {info['timer']}")
    return lines


def short_error(exc: BaseException, n: int = 160) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:n]}"


def measure(attn, x: Inputs, direction: str, timer):
    """``(ms, None)`` for ``attn`` in ``direction`` on ``x`` (first call = compile, then
    ``timer``), or ``(None, reason)`` when it cannot run (unsupported, out of memory)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA's "kernel not used because ..." chatter
            fn = direction_fn(attn, x, direction)
            fn()
            return timer(fn), None
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "out of memory"
    except Exception as exc:  # noqa: BLE001 - the peer does not run this case: say why
        return None, short_error(exc)
