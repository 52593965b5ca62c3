"""One harness for every ``solattn bench --suite NAME``: a suite is a table of rows (a shape, a
call) x peers (the implementations), each cell a call through a public API.

A :class:`Suite` lists its peers in column order and yields :class:`Row` s; a row's ``calls``
map a peer's name to a builder that returns the no-argument callable to time (or raises
:class:`~solattn.bench.peers.PeerUnavailable` / ``NotImplementedError`` with the reason it cannot
run here). :func:`run_rows` times every row's calls in interleaved rounds
(:func:`solattn.bench.core.time_rounds`) and records them in a
:class:`~solattn.bench.results.Results`. Without a GPU (Triton's interpreter) every call runs
once on the suite's tiny CPU shapes and is compared with the row's float64 reference where it
has one: the plumbing is verified, nothing is timed.

Suites that are not tables of calls (ring attention under torchrun, a transformers model, cold
starts in fresh processes) give their own ``run``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .core import (
    IDLE_GAP_S,
    ROUNDS,
    Timing,
    interpreting,
    max_abs_err,
    settle_clocks,
    short_error,
    time_rounds,
)
from .peers import PeerUnavailable
from .results import fmt, make_record

# Value of a row's cell from its milliseconds: work per time (higher is better) or the time itself.
UNITS = {
    "TFLOP/s": lambda work, ms: work / ms / 1e9,
    "GB/s": lambda work, ms: work / ms / 1e6,
    "us": lambda work, ms: ms * 1e3,
    "ms": lambda work, ms: ms,
    "tok/s": lambda work, ms: work / ms * 1e3,
}
LOWER_IS_BETTER = {"us", "ms"}
# The ceiling a unit's cells are a fraction of, by the name the tables give it.
PEAK_NAMES = {"TFLOP/s": "SOL", "GB/s": "read ceiling"}


@dataclass
class Row:
    """One line of a suite's table.

    ``calls``: peer name -> builder; the builder returns the no-argument callable that is timed
    (its return value, the output, is what the CPU check compares). ``work``: FLOPs for
    ``TFLOP/s``, bytes for ``GB/s``, tokens for ``tok/s``, unused for a time unit. ``timer``:
    ``events`` (do_bench median), ``graph`` (CUDA-graph replays, microsecond calls), ``host``
    (back-to-back calls, the host's time per call) or ``wall`` (one synchronized call, for calls
    of seconds). ``reference``: a callable giving the float64 output that every
    call's output must match within ``tol`` in the CPU check (None: the calls only have to run).
    """

    label: str
    calls: dict
    work: float | None = None
    unit: str = "TFLOP/s"
    section: str = "fwd"
    timer: str = "events"
    meta: dict = field(default_factory=dict)
    reference: object = None
    tol: float = 2e-2


@dataclass
class Context:
    """What a suite's rows depend on: device and dtype, ``quick`` (fewer rows), the CPU mode."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    quick: bool = False
    rounds: int = ROUNDS
    shapes: str | None = None
    peers: list | None = None
    args: object = None
    # the run's ceilings by unit: bf16 matmul TFLOP/s (SOL), HBM read GB/s; a table whose unit
    # has one gets a "best solattn / ..." column
    peaks: dict = field(default_factory=dict)

    @property
    def cpu(self) -> bool:
        return self.device != "cuda"

    @property
    def sm90(self) -> bool:
        return not self.cpu and torch.cuda.get_device_capability() == (9, 0)


@dataclass(frozen=True)
class Suite:
    """``rows(ctx)`` yields :class:`Row` s; ``peers`` are the table's columns in order;
    ``baseline`` the peer our best column is divided by in the ratio column (None: no ratio).
    ``run(ctx, results)`` replaces the table runner for suites that are not tables of calls;
    ``before(ctx, results)`` measures what the table is a fraction of (a ceiling, a peak).
    ``command`` is the line that reproduces the suite (BENCHMARKS.md cites it)."""

    name: str
    doc: str
    peers: tuple = ()
    rows: object = None
    baseline: str | None = None
    run: object = None
    command: str = ""
    before: object = None

    @property
    def reproduce(self) -> str:
        return self.command or f"solattn bench --suite {self.name}"


# Peers that need an sm_90 GPU: on another device they are reported as such, never called.
SM90_PEERS = ("solattn-hopper", "solattn-fp8", "solattn-determ")


def _host_ms(fn, n: int = 200, blocks: int = 5) -> float:
    """Host time per call: ``n`` calls back to back, synchronized at both ends, the median of
    ``blocks`` blocks (the GPU work of the calls it is meant for is a few microseconds)."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) * 1e3 / n)
    return sorted(per)[len(per) // 2]


def _wall_ms(fn) -> float:
    """One synchronized call's wall time (calls of seconds: a model step, a generation)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def timer_of(row: Row):
    from .core import time_graph_ms, time_ms

    return {"events": time_ms, "graph": time_graph_ms, "host": _host_ms,
            "wall": _wall_ms}[row.timer]


def not_here(peer: str, ctx: Context) -> str | None:
    """Why ``peer`` cannot run on this device, or None."""
    if peer in SM90_PEERS and not ctx.sm90:
        return "needs sm_90 (not timed)" if not ctx.cpu else "needs sm_90"
    return None


def selected(suite: Suite, ctx: Context) -> list[str]:
    if not ctx.peers:
        return list(suite.peers)
    return [p for p in suite.peers if p in ctx.peers]


def build_calls(row: Row, names, ctx: Context) -> tuple[dict, dict]:
    """``(fns, notes)``: the row's callables that ran once (the compile) and, for the others,
    why not."""
    import warnings

    fns, notes = {}, {}
    for name in names:
        if name not in row.calls:
            continue
        why = not_here(name, ctx)
        if why:
            notes[name] = why
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn = row.calls[name]()
                fn()
            fns[name] = fn
        except (PeerUnavailable, NotImplementedError) as exc:
            notes[name] = str(exc).split("\n")[0][:160]
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            notes[name] = "out of memory"
        except Exception as exc:  # noqa: BLE001 - the peer fails on this row: say why
            notes[name] = short_error(exc)
    return fns, notes


def _first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def check_row(row: Row, fns: dict) -> dict:
    """CPU check: ``{peer: max abs error}`` against the row's reference (empty without one)."""
    if row.reference is None:
        return {}
    ref = _first_tensor(row.reference())
    return {name: max_abs_err(_first_tensor(fn()).float(), ref.float())
            for name, fn in fns.items()}


def value_of(row: Row, ms: float | None) -> float | None:
    return UNITS[row.unit](row.work, ms) if ms else None


def record(res, row: Row, name: str, timing: Timing | None, note: str | None, **extra) -> dict:
    ms = timing.ms if timing else None
    rounds = timing.rounds if timing else []
    spread = timing.spread if timing else None
    return res.add(make_record(row.section, name, row.label, ms=ms, value=value_of(row, ms),
                               unit=row.unit, note=note, rounds=rounds, spread=spread,
                               **row.meta, **extra))


def run_rows(suite: Suite, ctx: Context, res, out=print) -> dict:
    """Time (GPU) or run once and check (CPU) every row of ``suite``; returns a summary
    ``{"rows": n, "checked": [...], "failed": [...], "not_run": {peer: reason}}``."""
    names = selected(suite, ctx)
    summary = {"rows": 0, "checked": [], "failed": [], "not_run": {}, "ran": set()}
    table: list[tuple[Row, dict, dict]] = []
    for row in suite.rows(ctx):
        if not label_matches(row.label, ctx.shapes):
            continue
        summary["rows"] += 1
        t_build = time.perf_counter()
        fns, notes = build_calls(row, names, ctx)
        if not ctx.cpu and time.perf_counter() - t_build > IDLE_GAP_S:
            # compilations left the GPU idle for a while: its clocks may have dropped
            settle_clocks(max_s=3.0)
        for n, why in notes.items():
            summary["not_run"].setdefault(n, why)
        if ctx.cpu:
            errs = check_row(row, fns)
            for n in fns:
                summary["ran"].add(n)
                err = errs.get(n)
                ok = err is None or err <= row.tol
                entry = f"{suite.name}: {row.label} {row.section}: {n}" + (
                    f" max err {err:.1e} (tol {row.tol:.0e})" if err is not None else " ran")
                (summary["checked"] if ok else summary["failed"]).append(entry)
                res.add_checks([dict(name=n, shape=row.label, what=suite.name, ok=ok, err=err,
                                     bound=row.tol if err is not None else None, note=None)])
            continue
        timings = time_rounds(fns, ctx.rounds, timer_of(row))
        for n in names:
            if n in row.calls:
                t = timings.get(n)
                record(res, row, n, t, notes.get(n) or (t.note if t else None))
        table.append((row, timings, notes))
        done = ", ".join(f"{n} {cell(t, row)}" for n, t in timings.items())
        print(f"[{suite.name} {len(table)}] {row.label} {row.section}: {done or 'nothing ran'}",
              file=sys.stderr, flush=True)
        del fns
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not ctx.cpu:
        print_table(suite, table, names, out, ctx.peaks)
    return summary


def print_table(suite, table, names, out=print, peaks=None) -> None:
    """The suite's table once every row is timed: a column per peer that has a number in some
    row (the others are named under the table with the reason), then the footer."""
    cols = [n for n in names if any(t.ms for _, timings, _ in table
                                    for m, t in timings.items() if m == n)]
    for i, (row, timings, _) in enumerate(table):
        print_row(suite, row, cols, timings, out,
                  header=i == 0 or table[i - 1][0].unit != row.unit,
                  peak=(peaks or {}).get(row.unit))
    print_footer(table, names, out)


def label_matches(label: str, patterns: str | None) -> bool:
    """``--shapes`` on a row label (as :func:`solattn.bench.core.shape_matches` on a shape):
    comma-separated alternatives whose space-separated tokens must all be in the label;
    ``full`` matches a label without ``causal``."""
    if not patterns:
        return True
    tokens = set(label.split()) | ({"full"} if "causal" not in label.split() else set())
    return any(set(alt.split()) <= tokens for alt in patterns.split(",") if alt.strip())


def cell(t: Timing | None, row: Row, note: str | None = None) -> str:
    if t is None or t.ms is None:
        return "-"
    return fmt(value_of(row, t.ms)) + ("!" if t.flagged else "")


def _ratio(suite: Suite, row: Row, timings: dict) -> str:
    base = timings.get(suite.baseline) if suite.baseline else None
    ours = [t for n, t in timings.items()
            if n.startswith("solattn") and n != suite.baseline and t.ms]
    if not base or not base.ms or not ours:
        return "-"
    best = min(t.ms for t in ours)
    return f"{base.ms / best:.2f}x"


def print_row(suite, row, names, timings, out, header: bool, peak: float | None = None) -> None:
    """One markdown row: the label and direction, a cell per peer (``!``: rounds disagree),
    the ratio to the baseline, the best solattn cell as % of ``peak`` (the unit's ceiling), the
    largest spread; ``header`` first prints the header (the unit is the header's, so a suite
    with rows of several units gets a header per unit)."""
    cols = [n for n in names if n in row.calls]
    extra = [f"best solattn / {suite.baseline}"] if suite.baseline else []
    with_peak = bool(peak) and row.unit in PEAK_NAMES
    extra += [f"best solattn / {PEAK_NAMES[row.unit]}"] if with_peak else []
    if header:
        out("")
        out(f"| {row.unit} | " + " | ".join(cols + extra) + " | spread |")
        out("|" + "---|" * (len(cols) + len(extra) + 2))
    spreads = [t.spread for t in timings.values() if t.spread is not None]
    spread = f"{100 * max(spreads):.1f}%" if spreads else "-"
    cells = [_ratio(suite, row, timings)] if suite.baseline else []
    if with_peak:
        ours = [value_of(row, t.ms) for n, t in timings.items() if n.startswith("solattn") and t.ms]
        cells.append(f"{100 * max(ours) / peak:.0f}%" if ours else "-")
    out(f"| {row.label} {row.section} | " + " | ".join(cell(timings.get(n), row) for n in cols)
        + "".join(f" | {c}" for c in cells) + f" | {spread} |")


def print_footer(table, names, out) -> None:
    flagged = [(f"{row.label} {row.section}", n, t) for row, timings, _ in table
               for n, t in timings.items() if t.flagged]
    notes: dict[str, str] = {}
    for _, timings, nts in table:
        for n in names:
            why = nts.get(n) or (timings[n].note if n in timings else None)
            if why and n not in notes:
                notes[n] = why
    from .core import SPREAD_FLAG

    if flagged:
        out(f"! rounds disagree by more than {100 * SPREAD_FLAG:.0f}% (max - min over median):")
        for label, n, t in flagged:
            rounds = ", ".join(f"{x:.3f}" for x in t.rounds)
            out(f"  {label} {n}: {100 * t.spread:.1f}% (ms per round: {rounds})")
    if notes:
        out("not timed: " + "; ".join(f"{n} ({why})" for n, why in notes.items()))


def cpu_summary(summaries: dict, out=print) -> None:
    """The CPU run's one statement: nothing was timed, and what was verified."""
    out("")
    out("Timings need a CUDA GPU; nothing was timed here. Verified in Triton's interpreter "
        "(tiny shapes, fp16):")
    for name, s in summaries.items():
        ran = sorted(s["ran"])
        out(f"  {name}: {s['rows']} rows, {len(s['checked'])} calls ok"
            + (f", {len(s['failed'])} FAILED" if s["failed"] else "")
            + (f" ({', '.join(ran)})" if ran else ""))
        for entry in s["checked"]:
            out(f"    ok {entry}")
        for entry in s["failed"]:
            out(f"    FAILED {entry}")
        if s["not_run"]:
            out("    not run here: " + "; ".join(f"{n} ({why})"
                                               for n, why in s["not_run"].items()))


def interpreting_cpu() -> bool:
    return not torch.cuda.is_available() and interpreting()
