"""``solattn bench --ladder``: the steps of :mod:`solattn.bench.ladder`, verified and timed.

Every step is first checked against the float64 oracle on small shapes; then each ladder shape
gets one row per step: TFLOP/s (forward FLOPs, causal halved, as everywhere), % of the bf16
matmul measured in the same run, the speed-up over the step it builds on, and the memory one
call allocates (the naive step's score matrix shows up there).
"""

from __future__ import annotations

import torch

from . import ladder
from .core import (
    Shape,
    attn_flops,
    call_memory_bytes,
    direction_fn,
    make_inputs,
    matmul_tflops,
    measure,
    shape_matches,
)
from .peers import PeerUnavailable
from .progress import Progress
from .results import fmt, make_record
from .verify import check, line

# The seeds' headline shape (seed 001: bs 1, 8 heads, Lq 4096, Lk 8192, d 128) and the causal
# anchor of BENCHMARKS.md. The naive step materializes 0.27 G and 1.07 G scores for them.
LADDER_SHAPES = [Shape(1, 8, 4096, 8192, 128), Shape(4, 16, 4096, 4096, 128, causal=True)]
# Ragged against every tile (304 = 4.75 x 64) but multiples of 16, as the timed lengths are:
# Triton specializes integer arguments on divisibility by 16, so these checks compile exactly the
# binaries that are timed. s_q > s_k causal: queries that see no key.
VERIFY_SHAPES = [Shape(1, 2, 304, 560, 128), Shape(1, 2, 304, 560, 128, causal=True),
                 Shape(1, 2, 560, 304, 128, causal=True)]
CPU_VERIFY_SHAPES = [Shape(1, 2, 33, 47, 32), Shape(1, 2, 47, 33, 32, causal=True)]


def _size(nbytes) -> str:
    if nbytes is None:
        return "-"
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def verify(results, device, dtype) -> None:
    shapes = VERIFY_SHAPES if device == "cuda" else CPU_VERIFY_SHAPES
    with Progress(len(ladder.STEPS) * len(shapes), "verify") as prog:
        for step in ladder.STEPS:
            for shape in shapes:
                prog.start(f"{step.name} {shape.label()}")
                entries = check(step.name, step.setup, shape, dtype=dtype, device=device,
                                strict=True)
                results.add_checks(entries)
                for e in entries:
                    prog.write(line(e))
                prog.done()


def time_steps(results, shapes, timer) -> None:
    sol = matmul_tflops()
    results.set("sol_tflops", sol)
    print(f"speed of light: bf16 8192^3 matmul {sol:.0f} TFLOP/s")
    with Progress(len(shapes) * len(ladder.STEPS), "ladder") as prog:
        for shape in shapes:
            x = make_inputs(shape)
            by_key = {}
            for step in ladder.STEPS:
                prog.start(f"compile + time {step.name} on {shape.label()}")
                try:
                    attn = step.setup(shape, x)
                    ms, note = measure(attn, x, "fwd", timer)
                except PeerUnavailable as exc:
                    attn, ms, note = None, None, str(exc)
                value = attn_flops(shape) / ms / 1e9 if ms else None
                mem = call_memory_bytes(direction_fn(attn, x, "fwd")) if ms else None
                base = by_key.get(step.vs, {}).get("value")
                if ms and getattr(attn, "is_default", False):
                    note = "the dispatcher's schedule for this shape"
                by_key[step.key] = results.add(make_record(
                    "ladder", step.name, shape, ms=ms, value=value, note=note, step=step.key,
                    change=step.change, seeds=step.seeds, vs=step.vs, call_bytes=mem,
                    pct_sol=100 * value / sol if value else None,
                    speedup=value / base if value and base else None))
                prog.done()
            del x
            torch.cuda.empty_cache()
            print_table(shape, list(by_key.values()), sol, results.data["dtype"])


def print_table(shape, rows, sol, dtype, out=print) -> None:
    """The ladder of one shape as a markdown table (README-ready)."""
    out("")
    out(f"### {shape.label()}, {dtype} (SOL: bf16 8192^3 matmul {sol:.0f} TFLOP/s, same run)")
    out("")
    out("| step | what it adds | TFLOP/s | % of SOL | speed-up | memory per call | seeds | note |")
    out("|---|---|---|---|---|---|---|---|")
    for r in rows:
        pct = f"{r['pct_sol']:.0f}%" if r["pct_sol"] else "-"
        up = f"{r['speedup']:.2f}x vs ({r['vs']})" if r["speedup"] else "-"
        out(f"| ({r['step']}) {r['name']} | {r['change']} | {fmt(r['value'])} | {pct} | {up} | "
            f"{_size(r['call_bytes'])} | {r['seeds']} | {r['note'] or ''} |")


def run(args, results, device, dtype, timer) -> None:
    if not args.no_verify:
        verify(results, device, dtype)
    if device != "cuda":
        print("Timings need a CUDA GPU: run `solattn bench --ladder` on a machine with one.")
        return
    shapes = [s for s in LADDER_SHAPES if shape_matches(s, args.shapes)]
    time_steps(results, shapes[:1] if args.quick else shapes, timer)
