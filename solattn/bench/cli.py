"""``solattn bench``: check solattn against a float64 reference, then time it beside its peers.

The text of :data:`DESCRIPTION` is what ``solattn bench --help`` prints.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from .core import (
    DIRECTIONS,
    ROUNDS,
    Shape,
    clock_line,
    env_info,
    gpu_clocks,
    header_lines,
    interpreting,
    matmul_tflops,
    settle_clocks,
    time_cpu_ms,
    time_ms,
)

DESCRIPTION = """\
Check solattn's kernels against a float64 reference, then time them beside other attention
implementations on the same inputs (TFLOP/s, GB/s or microseconds per call).

modes:
  solattn bench                  the anchor shapes: forward, backward and decode suites
                                 (what `make bench` runs; a few minutes on an H100)
  solattn bench --suite NAME     one suite (repeat or comma-separate for several);
                                 --list names them all with what they measure
  solattn bench --ladder         the seeds' progression (naive -> tiled -> tensor cores ->
                                 pipelining -> exp2/skipping -> shipping kernels)
  solattn bench --sweep --out D  every installed peer over sequence lengths 512..32k, head
                                 dims 64/128/256; D/bench.json and one PNG per plot

timing: before the first timing the GPU is brought to its clocks (a bf16 matmul burn until
its rate settles); each row's peers are timed in interleaved rounds (--rounds, default 5;
triton.testing.do_bench medians) and each cell is the median of its rounds; a cell whose
rounds disagree by more than 3% is marked with "!". The SM clock is printed before and after.

A/B in one run: --trees A B times a suite with PYTHONPATH=A and PYTHONPATH=B (one worker
process each, interleaved rounds); --config KEY=VAL times a config variant beside the
unchanged code (e.g. hopper_fwd_config.persistent=True).

Every mode checks what it times first and exits 1 when a check fails (2 on bad arguments).
--json FILE writes the results; --compare OLD.json prints ratios against a previous run.
Without a GPU, set TRITON_INTERPRET=1: the kernels are checked in Triton's interpreter on tiny
shapes and nothing is timed.
"""

# Forward checks: odd lengths, GQA, d=256, bottom-right causal with s_q != s_k (SDPA skips it).
VERIFY_SHAPES = [
    Shape(1, 4, 257, 1000, 128, causal=True),
    Shape(2, 4, 1000, 1000, 64, h_kv=2),
    Shape(1, 2, 333, 333, 256),
]
# Gradient checks of the backward peers (square: SDPA's causal mask is top-left aligned).
GRAD_VERIFY_SHAPES = [Shape(1, 4, 300, 300, 128, causal=True), Shape(2, 4, 1000, 1000, 64, h_kv=2)]
CPU_VERIFY_SHAPES = [
    Shape(1, 2, 33, 47, 64, causal=True),
    Shape(2, 4, 40, 40, 32, h_kv=2),
    Shape(1, 2, 17, 17, 40, d_v=24),
]
# --sections of the default mode -> the suites it runs.
ANCHOR_SECTIONS = {"fwd": "forward", "bwd": "backward", "decode": "decode"}


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from exc
    return vals


def add_arguments(p) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--suite", action="append", default=None, metavar="NAME",
                      help="run this suite (repeatable, or comma-separated); --list names them")
    mode.add_argument("--list", action="store_true", help="list the suites and exit")
    mode.add_argument("--ladder", action="store_true",
                      help="the seeds' ladder: naive -> tiled -> tensor cores -> pipelining -> "
                           "exp2/skipping -> shipping kernels, one row per step")
    mode.add_argument("--sweep", action="store_true",
                      help="every installed peer over seqlens 512..32k, head dims 64/128/256, "
                           "causal and not, fwd/bwd/fwdbwd; writes DIR/bench.json and PNGs")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timing rounds per row (default 5)")
    p.add_argument("--trees", nargs="+", default=None, metavar="TREE",
                   help="with --suite: time the suite on each source tree (a checkout's root, "
                        "or NAME=PATH), one worker process each, interleaved rounds")
    p.add_argument("--config", action="append", default=None, metavar="KEY=VAL",
                   help="with --suite: also time this config variant (FUNCTION.FIELD=VALUE or "
                        "CONSTANT=VALUE, several comma-separated); repeatable")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (--sweep: default ./bench-out; other modes: JSON)")
    p.add_argument("--quick", action="store_true",
                   help="fewer rows (default mode: 3 forward shapes; --sweep: d=128, 1k/4k/16k;"
                        " --ladder: the first shape)")
    p.add_argument("--peers", default=None,
                   help="comma-separated peers (default: every peer the suite has)")
    p.add_argument("--shapes", default=None,
                   help="keep rows whose label has all words of one comma-separated "
                        "alternative, e.g. 'D128 causal,D64' ('full' = not causal)")
    p.add_argument("--sections", default=None,
                   help="default mode: a subset of fwd,bwd,decode; --sweep: of fwd,bwd,fwdbwd")
    p.add_argument("--seqlens", type=_int_list, default=None, help="--sweep: sequence lengths")
    p.add_argument("--hdims", type=_int_list, default=None, help="--sweep: head dims")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="--sweep: start no timing after this many minutes (the rest is recorded "
                        "as skipped; JSON and plots are still written)")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--no-verify", action="store_true", help="skip the correctness checks")
    p.add_argument("--compare", default=None, metavar="OLD.json",
                   help="print ratios of this run's results to a previous run's")
    p.add_argument("--to", default=None, metavar="NEW.json",
                   help="with --compare: compare this file instead of running anything")


def _suite_names(args) -> list[str]:
    return [n.strip() for text in args.suite or [] for n in text.split(",") if n.strip()]


def _check_args(args) -> str | None:
    """A usage error, or None."""
    from .peers import PEERS
    from .suites import SUITES

    names = _suite_names(args)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        return f"--suite: unknown {unknown}; known: {', '.join(SUITES)}"
    if args.peers and not names:
        unknown = [n for n in args.peers.split(",") if n not in PEERS]
        if unknown:
            return f"--peers: unknown {unknown}; known: {list(PEERS)}"
    if args.peers and names:
        known = {p for n in names for p in SUITES[n].peers}
        unknown = [n for n in args.peers.split(",") if n not in known]
        if unknown:
            return f"--peers: unknown {unknown} for these suites; known: {sorted(known)}"
    if (args.trees or args.config) and not names:
        return "--trees and --config apply to --suite"
    if (args.trees or args.config) and any(SUITES[n].run for n in names):
        return "--trees and --config apply to table suites (not ring, cold-start)"
    if args.trees or args.config:
        from .ab import variants

        try:
            variants(args.trees, args.config)
        except ValueError as exc:
            return str(exc)
    if args.rounds is not None and args.rounds < 1:
        return f"--rounds: expected a positive integer, got {args.rounds}"
    if args.sections:
        allowed = DIRECTIONS if args.sweep else tuple(ANCHOR_SECTIONS)
        unknown = [s for s in args.sections.split(",") if s not in allowed]
        if args.ladder or names:
            return f"--sections does not apply to {'--ladder' if args.ladder else '--suite'}"
        if unknown:
            return f"--sections: expected a subset of {','.join(allowed)}, got {args.sections!r}"
    if not args.sweep:
        for name in ("seqlens", "hdims", "max_minutes"):
            if getattr(args, name) is not None:
                return f"--{name.replace('_', '-')} applies to --sweep only"
    if args.hdims and any(d not in (16, 32, 64, 128, 256) for d in args.hdims):
        return f"--hdims: expected values among 16,32,64,128,256, got {args.hdims}"
    if args.seqlens and any(n < 1 for n in args.seqlens):
        return f"--seqlens: expected positive lengths, got {args.seqlens}"
    if args.max_minutes is not None and args.max_minutes <= 0:
        return f"--max-minutes: expected a positive number, got {args.max_minutes}"
    if args.to and not args.compare:
        return "--to needs --compare OLD.json"
    return None


def _peers(names, default, section=None):
    from .peers import PEERS

    chosen = [PEERS[n] for n in (names.split(",") if names else default)]
    return [p for p in chosen if section is None or section in p.directions]


def print_suites(out=print) -> None:
    from .suites import SUITES

    for s in SUITES.values():
        out(f"{s.name:<13} {s.doc}")
        out(f"{'':<13} {s.reproduce}" + (f"  (peers: {', '.join(s.peers)})" if s.peers else ""))


def run(args) -> int:
    from . import results as R

    err = _check_args(args)
    if err:
        print(f"solattn bench: {err}", file=sys.stderr)
        return 2
    if args.list:
        print_suites()
        return 0
    old = None
    if args.compare:
        try:
            old = R.load(args.compare)
            new = R.load(args.to) if args.to else None
        except (OSError, ValueError) as exc:
            print(f"solattn bench: --compare: {exc}", file=sys.stderr)
            return 2
        if new is not None:
            R.print_compare(R.compare(old, new), args.compare, args.to)
            return 0
    cuda = torch.cuda.is_available()
    if not cuda and not interpreting():
        print("no CUDA GPU: set TRITON_INTERPRET=1 to check the kernels in Triton's interpreter")
        return 1
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    timer = time_ms if cuda else time_cpu_ms
    names = _suite_names(args)
    mode = ("ladder" if args.ladder else "sweep" if args.sweep else
            "suite:" + ",".join(names) if names else "anchors")
    out_dir = args.out or ("bench-out" if args.sweep else None)
    json_path = args.json or (os.path.join(out_dir, "ladder.json" if args.ladder else "bench.json")
                              if out_dir else None)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 writes the results
        json_path = None
    env = env_info()
    print(f"solattn bench ({mode})")
    for text in header_lines(env):
        print(text)
    if cuda:  # the seed documents' own rows for this GPU (bench/seeds.py), where one exists
        from .seeds import reference_lines

        major, minor = torch.cuda.get_device_capability()
        for text in reference_lines(major * 10 + minor, torch.cuda.get_device_name()):
            print(text)
    if cuda:
        check = "no verification" if args.no_verify else "verification on"
        print(f"peers: {args.peers or 'every peer of the table that is installed'}; rows: "
              f"{args.shapes or 'all'}; {check}")
    elif args.sweep:
        print("no GPU: the sweep's plumbing on tiny shapes with a CPU wall clock (numbers that say "
              "nothing about speed)")
    else:
        print("no GPU: nothing is timed; the kernels are checked in Triton's interpreter")
    res = R.Results(mode, env, json_path, dtype=str(dtype).replace("torch.", ""),
                    args={k: v for k, v in vars(args).items() if k != "func"})
    if cuda:
        _settle(res)
    if mode == "ladder":
        from . import ladder_run

        ladder_run.run(args, res, device, dtype, timer)
    elif mode == "sweep":
        run_sweep(args, res, device, dtype, timer, out_dir)
    elif names:
        run_suites(args, names, res, device, dtype)
    else:
        run_anchors(args, res, device, dtype)
    if cuda:
        after = gpu_clocks()
        res.set("clocks_after", after)
        print(clock_line(after, "after the last timing"))
    bad = [e for e in res.data["verify"] if e["ok"] is False]
    if bad:
        print(f"\nverification FAILED ({len(bad)} check(s)):", file=sys.stderr)
        from .verify import line

        for e in bad:
            print(line(e), file=sys.stderr)
    elif res.data["verify"]:
        print("\nverification passed")
    if json_path:
        print(f"results: {json_path}")
    if old is not None:
        R.print_compare(R.compare(old, res.data), args.compare, json_path or "this run")
    return 1 if bad else 0


def _settle(res) -> None:
    """Print the clock before, burn until the matmul rate settles, print what it took."""
    before = gpu_clocks()
    res.set("clocks_before", before)
    if "sm_clock_mhz" not in res.data["env"]:  # (else the header said it)
        print(clock_line(before, "before the warm-up"))
    s = settle_clocks()
    res.set("clock_settle", s)
    rates = ", ".join(f"{r:.0f}" for r in s["rates"])
    verdict = "settled" if s["settled"] else "NOT settled (timings may read low)"
    print(f"warm-up: bf16 matmul bursts {rates} TFLOP/s, {verdict} after {s['seconds']:.1f} s; "
          + clock_line(gpu_clocks(), "now"))


def _context(args, device, dtype):
    from .suite import Context

    return Context(device=device, dtype=dtype, quick=args.quick,
                   rounds=args.rounds or ROUNDS, shapes=args.shapes,
                   peers=args.peers.split(",") if args.peers else None, args=args)


def run_suites(args, names, res, device, dtype, ctx=None) -> dict:
    """Every suite of ``names``, one table each; on the CPU, one statement of what ran."""
    from .suite import cpu_summary, run_rows
    from .suites import SUITES

    ctx = ctx or _context(args, device, dtype)
    summaries = {}
    if not ctx.cpu and any(SUITES[n].rows for n in names) and not res.data.get("sol_tflops"):
        _speed_of_light(res)
    if res.data.get("sol_tflops"):
        ctx.peaks["TFLOP/s"] = res.data["sol_tflops"]
    for name in names:
        suite = SUITES[name]
        print(f"\n## {suite.name}: {suite.doc}")
        print(f"reproduce: {suite.reproduce}")
        if suite.before is not None:
            suite.before(ctx, res)
        if suite.run is not None:
            summaries[name] = suite.run(ctx, res)
        elif args.trees or args.config:
            from .ab import run_variants, variants

            summaries[name] = run_variants(suite, ctx, res, variants(args.trees, args.config))
        else:
            summaries[name] = run_rows(suite, ctx, res)
    if ctx.cpu:
        cpu_summary(summaries)
    return summaries


def _speed_of_light(res) -> None:
    sol = matmul_tflops()
    res.set("sol_tflops", sol)
    print(f"speed of light: bf16 8192^3 matmul {sol:.0f} TFLOP/s")


def _verify(res, peers, shapes, device, dtype, grads_for=()) -> list:
    """Check ``peers`` on ``shapes``; returns the peers that cannot run on this device."""
    from .progress import Progress
    from .suite import SM90_PEERS
    from .verify import check, line

    sm90 = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    skipped = [p for p in peers if p.name in SM90_PEERS and not sm90]
    jobs = [(p, s) for p in peers if p not in skipped for s in shapes]
    with Progress(len(jobs), "verify") as prog:
        for peer, shape in jobs:
            prog.start(f"{peer.name} {shape.label()}")
            entries = check(peer.name, peer.setup, shape, dtype=dtype, device=device,
                            grads=peer.name in grads_for,
                            strict=peer.name.startswith("solattn"))
            res.add_checks(entries)
            for e in entries:
                prog.write(line(e))
            prog.done()
    return skipped


def run_anchors(args, res, device, dtype) -> None:
    """The default mode: BENCHMARKS.md's anchors, the forward, backward and decode suites."""
    from .peers import BACKWARD_DEFAULT, FORWARD_DEFAULT

    sections = (args.sections or "fwd,bwd,decode").split(",")
    fwd_peers = _peers(args.peers, FORWARD_DEFAULT, "fwd")
    if device != "cuda":
        ours = [p for p in fwd_peers if p.name.startswith("solattn")]
        if args.no_verify:
            print("Timings need a CUDA GPU; nothing was checked (--no-verify).")
            return
        skipped = _verify(res, ours, CPU_VERIFY_SHAPES, device, dtype)
        ran = [p.name for p in ours if p not in skipped]
        n_ok = sum(1 for e in res.data["verify"] if e["ok"])
        print("\nTimings need a CUDA GPU; nothing was timed. Verified in Triton's interpreter "
              f"(fp16): {', '.join(ran) or 'nothing'} on {len(CPU_VERIFY_SHAPES)} shapes "
              f"({n_ok} checks passed)"
              + (f"; not run here: {', '.join(f'{p.name} (needs sm_90)' for p in skipped)}"
                 if skipped else "") + ". Run `make bench` on a machine with a GPU.")
        return
    bwd_peers = _peers(args.peers, BACKWARD_DEFAULT, "bwd")
    if not args.no_verify:
        if "fwd" in sections:
            # solattn on every check shape; the peers on one (each shape costs FlexAttention a
            # compilation, and `make bench` stays within a few minutes)
            ours = [p for p in fwd_peers if p.name.startswith("solattn")]
            _verify(res, ours, VERIFY_SHAPES, device, dtype)
            _verify(res, [p for p in fwd_peers if p not in ours], VERIFY_SHAPES[1:2], device,
                    dtype)
        if "bwd" in sections:
            _verify(res, bwd_peers, GRAD_VERIFY_SHAPES, device, dtype,
                    grads_for={p.name for p in bwd_peers})
    names = [ANCHOR_SECTIONS[s] for s in sections]
    ctx = _context(args, device, dtype)
    if args.peers:  # the default mode's --peers names peers of any of its suites
        from .suites import SUITES

        known = {p for n in names for p in SUITES[n].peers}
        ctx.peers = [p for p in args.peers.split(",") if p in known]
    run_suites(args, names, res, device, dtype, ctx)


def run_sweep(args, res, device, dtype, timer, out_dir) -> None:
    from . import plots, sweep
    from .peers import SWEEP_DEFAULT
    from .progress import Progress

    t_start = time.monotonic()
    cpu = device != "cuda"
    quick = args.quick
    seqlens = args.seqlens or (sweep.CPU_SEQLENS if cpu else
                               sweep.QUICK_SEQLENS if quick else sweep.SEQLENS)
    hdims = args.hdims or (sweep.CPU_HEAD_DIMS if cpu else
                           sweep.QUICK_HEAD_DIMS if quick else sweep.HEAD_DIMS)
    directions = (args.sections or ",".join(DIRECTIONS)).split(",")
    shapes = sweep.sweep_shapes(seqlens, hdims, cpu=cpu, patterns=args.shapes)
    if not shapes:
        print("--shapes left no shape to sweep")
        return
    peers, why = sweep.available(_peers(args.peers, SWEEP_DEFAULT), shapes[0], device, dtype)
    for name, reason in why.items():
        print(f"  peer {name}: not available ({reason})")
    plan = sweep.Plan(shapes, peers, directions)
    checks = [] if args.no_verify else sweep.verify_shapes(shapes, cpu=cpu)
    est = sweep.estimate_s(plan, checks)
    print(f"sweep: {len(shapes)} shapes (head dims {sorted({s.d for s in shapes})}, seqlens "
          f"{sorted({s.s_q for s in shapes})}, causal and not) x {directions} x "
          f"{len(peers)} peers ({', '.join(p.name for p in peers)}) = {plan.timings} timings")
    print(f"estimate: about {est / 60:.0f} min on an H100 with cold compile caches "
          f"({sweep.TIMING_S} s per timing + compilations)"
          + ("" if quick or cpu else "; --quick: about "
             f"{sweep.estimate_s(_quick_plan(plan, args), checks) / 60:.0f} min"))
    if args.max_minutes:
        print(f"budget: no timing starts after {args.max_minutes:g} min")
    if checks:
        grads = {p.name for p in peers if any(d != "fwd" for d in plan.directions_of(p))}
        _verify(res, peers, checks, device, dtype, grads_for=grads)
    if not cpu:
        sol = matmul_tflops()
        res.set("sol_tflops", sol)
        print(f"speed of light: bf16 8192^3 matmul {sol:.0f} TFLOP/s")
    deadline = t_start + 60 * args.max_minutes if args.max_minutes else None
    with Progress(plan.timings, "sweep", estimate_s=est) as prog:
        sweep.run(plan, res, prog, timer, device, dtype, deadline=deadline)
    sweep.print_tables(res.records, [p.name for p in peers])
    if not plots.matplotlib_available():
        print("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return
    try:
        paths = plots.write_plots(res.data, out_dir)
    except Exception as exc:  # noqa: BLE001 - the numbers are in the JSON; say what failed
        print(f"plots failed: {type(exc).__name__}: {exc}")
        return
    print("plots: " + ", ".join(paths))


def _quick_plan(plan, args):
    from . import sweep

    shapes = sweep.sweep_shapes(sweep.QUICK_SEQLENS, sweep.QUICK_HEAD_DIMS,
                                patterns=args.shapes)
    return sweep.Plan(shapes, plan.peers, plan.directions)


def _quick_plan(plan, args):
    from . import sweep

    shapes = sweep.sweep_shapes(sweep.QUICK_SEQLENS, sweep.QUICK_HEAD_DIMS,
                                patterns=args.shapes)
    return sweep.Plan(shapes, plan.peers, plan.directions)


def verify_in_interpreter() -> int:
    """``solattn bench`` without a GPU (kept for callers of the old entry point)."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args([]))
