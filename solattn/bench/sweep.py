"""``solattn bench --sweep``: every installed peer over sequence lengths, head dims, causal and
not, forward / backward / forward + backward; ``bench.json`` and PNG plots in ``--out``.

Shapes follow flash-attn's benchmark charts: ``batch * seqlen = 16k`` tokens and
``heads * head_dim = 2048`` (batch 1 from 16k on), so every point moves the same number of
tokens. The loop runs shape by shape and, for each shape, peer by peer and direction by
direction, so one peer's compiled kernels and the inputs are reused across directions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .core import DIRECTIONS, Shape, attn_flops, make_inputs, measure, shape_matches
from .peers import Peer, PeerUnavailable
from .results import Results, fmt, make_record

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128, 256)
QUICK_SEQLENS = (1024, 4096, 16384)
QUICK_HEAD_DIMS = (128,)
# Triton's interpreter (no GPU): the same plumbing on shapes it runs in seconds.
CPU_SEQLENS = (40,)
CPU_HEAD_DIMS = (32,)
TOKENS = 16384
MODEL_DIM = 2048
# Rough seconds per timing on an H100 (setup + warm-up + do_bench), for the up-front estimate.
TIMING_S = 0.6


def sweep_shapes(seqlens, head_dims, cpu: bool = False, patterns: str | None = None):
    shapes = []
    for d in head_dims:
        for causal in (False, True):
            for n in seqlens:
                if cpu:
                    s = Shape(1, 2, n, n, d, causal)
                else:
                    s = Shape(max(1, TOKENS // n), max(1, MODEL_DIM // d), n, n, d, causal)
                if shape_matches(s, patterns):
                    shapes.append(s)
    return shapes


def verify_shapes(shapes, cpu: bool = False):
    """One small square shape per (head dim, causal) of the sweep (square: SDPA's causal mask is
    top-left aligned). Its length is ragged against every tile but a multiple of 16 like the
    timed ones, so the checks compile the binaries that are then timed (Triton specializes
    integer arguments on divisibility by 16)."""
    n = 33 if cpu else 304
    keys = sorted({(s.d, s.causal) for s in shapes})
    return [Shape(1, 2, n, n, d, causal) for d, causal in keys]


@dataclass
class Plan:
    shapes: list
    peers: list
    directions: list

    def directions_of(self, peer: Peer) -> list[str]:
        return [d for d in self.directions if d in peer.directions]

    @property
    def timings(self) -> int:
        return len(self.shapes) * sum(len(self.directions_of(p)) for p in self.peers)


def available(peers, shape: Shape, device, dtype) -> tuple[list, dict]:
    """Peers whose setup accepts a tiny version of ``shape`` here, and why the others do not."""
    tiny = Shape(1, 1, 64, 64, shape.d, shape.causal)
    x = make_inputs(tiny, dtype=dtype, device=device)
    ok, why = [], {}
    for p in peers:
        try:
            p.setup(tiny, x)
            ok.append(p)
        except PeerUnavailable as exc:
            why[p.name] = str(exc)
        except Exception as exc:  # noqa: BLE001
            why[p.name] = f"{type(exc).__name__}: {exc}"
    return ok, why


def estimate_s(plan: Plan, verify: list) -> float:
    """Seconds the sweep should take on an H100 with cold compile caches: TIMING_S per timing,
    plus each peer's ``compile_s`` per distinct compilation (verification shapes included)."""
    total = plan.timings * TIMING_S
    for p in plan.peers:
        keys = set()
        for s in list(plan.shapes) + list(verify):
            for d in plan.directions_of(p):
                grad = d != "fwd"
                keys.add((s, grad) if p.compile_per == "shape" else (s.d, s.causal, grad))
        total += len(keys) * p.compile_s
    return total


def run(plan: Plan, results: Results, progress, timer, device, dtype, deadline=None) -> None:
    """Time every (shape, peer, direction) of ``plan`` into ``results``; after ``deadline``
    (``time.monotonic()``) the remaining ones are recorded as skipped."""
    for shape in plan.shapes:
        x = make_inputs(shape, dtype=dtype, device=device)
        for peer in plan.peers:
            dirs = plan.directions_of(peer)
            if not dirs:
                continue
            try:
                attn, why = peer.setup(shape, x), None
            except PeerUnavailable as exc:
                attn, why = None, str(exc)
            for direction in dirs:
                if attn is not None and deadline is not None and time.monotonic() > deadline:
                    attn, why = None, "skipped: the --max-minutes budget was spent"
                if attn is None:
                    results.add(make_record(direction, peer.name, shape, note=why))
                    progress.done()
                    continue
                progress.start(f"{peer.name} {direction} {shape.label()}")
                ms, note = measure(attn, x, direction, timer)
                value = attn_flops(shape, direction=direction) / ms / 1e9 if ms else None
                results.add(make_record(direction, peer.name, shape, ms=ms, value=value,
                                        note=note))
                progress.done()
        del x
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def print_tables(records, names, out=print) -> None:
    """One markdown table per (direction, head dim): TFLOP/s per peer by sequence length, and
    solattn's ratio to the best other peer."""
    for direction in DIRECTIONS:
        for d in sorted({r["d"] for r in records if r["section"] == direction}):
            group = [r for r in records if r["section"] == direction and r["d"] == d]
            cols = [n for n in names if any(r["name"] == n and r["value"] for r in group)]
            if not cols:
                continue
            out("")
            out(f"{direction}, head dim {d} (TFLOP/s)")
            out("| shape | " + " | ".join(cols) + " | solattn / best other |")
            out("|" + "---|" * (len(cols) + 2))
            rows: dict[str, dict] = {}
            for r in group:
                rows.setdefault(r["shape"], {})[r["name"]] = r["value"]
            for label, vals in rows.items():
                ours = vals.get("solattn")
                others = [v for n, v in vals.items() if v and not n.startswith("solattn")]
                ratio = f"{ours / max(others):.2f}x" if ours and others else "-"
                out(f"| {label} | " + " | ".join(fmt(vals.get(n)) for n in cols) + f" | {ratio} |")
