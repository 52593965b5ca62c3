"""``solattn bench``: verify against the float64 reference, then time solattn and its peers.

Three modes, one protocol (:mod:`solattn.bench.core`) and one results file
(:mod:`solattn.bench.results`):

* default: the anchor shapes of BENCHMARKS.md, forward and backward TFLOP/s per peer with ratios
  to cuDNN, then decode steps in GB/s against the HBM read ceiling (``make bench``; a few
  minutes on an H100);
* ``--ladder``: the seeds' progression rebuilt with our own code, one row per step
  (:mod:`solattn.bench.ladder`);
* ``--sweep --out DIR``: every installed peer over sequence lengths 512..32k, head dims
  64/128/256, causal and not, forward / backward / forward + backward; ``DIR/bench.json`` and one
  PNG per (direction, head dim).

Every mode verifies what it times first and exits 1 when a check fails (2 on bad arguments).
``--compare OLD.json`` prints ratios against a previous run (``--to NEW.json``: compare two files,
run nothing). Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``):
verification only for the default and ladder modes; the sweep then runs its plumbing on tiny
shapes with a CPU wall clock (numbers that say nothing about speed).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from solattn.bench.core import (
    DIRECTIONS,
    Shape,
    env_info,
    gpu_clocks,
    header_lines,
    interpreting,
    matmul_tflops,
    shape_matches,
    time_cpu_ms,
    time_ms,
)

# The issues' anchor shapes (H100 numbers for the peers are in BENCHMARKS.md).
FORWARD_SHAPES = [
    Shape(1, 8, 4096, 8192, 128),
    Shape(4, 16, 4096, 4096, 128),
    Shape(4, 16, 4096, 4096, 128, causal=True),
    Shape(1, 16, 16384, 16384, 128),
    Shape(1, 16, 16384, 16384, 128, causal=True),
    Shape(4, 32, 4096, 4096, 64),
    Shape(2, 8, 4096, 4096, 256),
]
QUICK_SHAPES = FORWARD_SHAPES[:3]
BACKWARD_SHAPES = [
    Shape(4, 16, 4096, 4096, 128),
    Shape(4, 16, 4096, 4096, 128, causal=True),
    Shape(4, 32, 4096, 4096, 64),
    Shape(4, 32, 4096, 4096, 64, causal=True),
]
# (batch, h_q, h_kv, cache length, head dim): the decode anchors.
DECODE_SHAPES = [(64, 32, 8, 4096, 128), (8, 32, 8, 32768, 128)]
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
ANCHOR_SECTIONS = ("fwd", "bwd", "fwdbwd", "decode")


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
    mode.add_argument("--ladder", action="store_true",
                      help="the seeds' ladder: naive -> tiled -> tensor cores -> pipelining -> "
                           "exp2/skipping -> shipping kernels, one row per step")
    mode.add_argument("--sweep", action="store_true",
                      help="every installed peer over seqlens 512..32k, head dims 64/128/256, "
                           "causal and not, fwd/bwd/fwdbwd; writes DIR/bench.json and PNGs")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (--sweep: default ./bench-out; other modes: JSON)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes (default: 3 forward shapes; --sweep: d=128, 1k/4k/16k; "
                        "--ladder: the first shape)")
    p.add_argument("--peers", default=None,
                   help="comma-separated peers (default: all installed); see solattn.bench.peers")
    p.add_argument("--shapes", default=None,
                   help="keep shapes whose label has all tokens of one comma-separated "
                        "alternative, e.g. 'D128 causal,D64' ('full' = not causal)")
    p.add_argument("--sections", default=None,
                   help="comma-separated subset of fwd,bwd,fwdbwd,decode (default: fwd,bwd,decode;"
                        " --sweep: fwd,bwd,fwdbwd)")
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


def _check_args(args) -> str | None:
    """A usage error, or None."""
    from solattn.bench.peers import PEERS

    if args.peers:
        unknown = [n for n in args.peers.split(",") if n not in PEERS]
        if unknown:
            return f"--peers: unknown {unknown}; known: {list(PEERS)}"
    if args.sections:
        allowed = DIRECTIONS if args.sweep else ANCHOR_SECTIONS
        unknown = [s for s in args.sections.split(",") if s not in allowed]
        if unknown or args.ladder:
            return (f"--sections: expected a subset of {','.join(allowed)}, got {args.sections!r}"
                    if not args.ladder else "--sections does not apply to --ladder")
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
    from solattn.bench.peers import PEERS

    chosen = [PEERS[n] for n in (names.split(",") if names else default)]
    return [p for p in chosen if section is None or section in p.directions]


def run(args) -> int:
    from solattn.bench import results as R

    err = _check_args(args)
    if err:
        print(f"solattn bench: {err}", file=sys.stderr)
        return 2
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
        print("no CUDA GPU: set TRITON_INTERPRET=1 to verify the kernels in Triton's interpreter")
        return 1
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    timer = time_ms if cuda else time_cpu_ms
    mode = "ladder" if args.ladder else "sweep" if args.sweep else "anchors"
    out_dir = args.out or ("bench-out" if args.sweep else None)
    json_path = args.json or (os.path.join(out_dir, "ladder.json" if args.ladder else "bench.json")
                              if out_dir else None)
    env = env_info()
    print(f"solattn bench ({mode})")
    for text in header_lines(env):
        print(text)
    print(f"peers: {args.peers or 'all installed'}; shapes: {args.shapes or 'all'}; "
          f"{'no verification' if args.no_verify else 'verification on'}")
    res = R.Results(mode, env, json_path, dtype=str(dtype).replace("torch.", ""),
                    args={k: v for k, v in vars(args).items() if k != "func"})
    if mode == "ladder":
        from solattn.bench import ladder_run

        ladder_run.run(args, res, device, dtype, timer)
    elif mode == "sweep":
        run_sweep(args, res, device, dtype, timer, out_dir)
    else:
        run_anchors(args, res, device, dtype, timer)
    if cuda:
        res.set("clocks_after", gpu_clocks())
    bad = [e for e in res.data["verify"] if e["ok"] is False]
    if bad:
        print(f"\nverification FAILED ({len(bad)} check(s)):", file=sys.stderr)
        from solattn.bench.verify import line

        for e in bad:
            print(line(e), file=sys.stderr)
    elif res.data["verify"]:
        print("\nverification passed")
    if json_path:
        print(f"results: {json_path}")
    if old is not None:
        R.print_compare(R.compare(old, res.data), args.compare, json_path or "this run")
    return 1 if bad else 0


def _verify(res, peers, shapes, device, dtype, grads_for=()) -> None:
    from solattn.bench.progress import Progress
    from solattn.bench.verify import check, line

    jobs = [(p, s) for p in peers for s in shapes]
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


def run_anchors(args, res, device, dtype, timer) -> None:
    """The default mode: BENCHMARKS.md's anchor shapes."""
    from solattn.bench.peers import BACKWARD_DEFAULT, FORWARD_DEFAULT
    from solattn.bench.progress import Progress
    from solattn.bench.results import pivot, print_table
    from solattn.bench.sweep import Plan
    from solattn.bench.sweep import run as run_plan

    sections = (args.sections or "fwd,bwd,decode").split(",")
    fwd_peers = _peers(args.peers, FORWARD_DEFAULT, "fwd")
    if device != "cuda":
        if not args.no_verify:
            print("No CUDA GPU: verifying in Triton's interpreter (fp16, small shapes).")
            _verify(res, [p for p in fwd_peers if p.name.startswith("solattn")],
                    CPU_VERIFY_SHAPES, device, dtype)
        print("Timings need a CUDA GPU: run `make bench` on a machine with one.")
        return
    bwd_peers = {s: _peers(args.peers, BACKWARD_DEFAULT, s) for s in ("bwd", "fwdbwd")}
    if not args.no_verify:
        if "fwd" in sections:
            # solattn on every check shape; the peers on one (each shape costs FlexAttention a
            # compilation, and `make bench` stays within a few minutes)
            ours = [p for p in fwd_peers if p.name.startswith("solattn")]
            _verify(res, ours, VERIFY_SHAPES, device, dtype)
            _verify(res, [p for p in fwd_peers if p not in ours], VERIFY_SHAPES[1:2], device,
                    dtype)
        grad_peers = {p.name: p for s in ("bwd", "fwdbwd") if s in sections for p in bwd_peers[s]}
        _verify(res, list(grad_peers.values()), GRAD_VERIFY_SHAPES, device, dtype,
                grads_for=set(grad_peers))
    sol = matmul_tflops()
    res.set("sol_tflops", sol)
    print(f"speed of light: bf16 8192^3 matmul {sol:.0f} TFLOP/s")
    for section in ("fwd", "bwd", "fwdbwd"):
        if section not in sections:
            continue
        shapes = FORWARD_SHAPES if section == "fwd" else BACKWARD_SHAPES
        if args.quick:
            shapes = QUICK_SHAPES if section == "fwd" else shapes[:2]
        shapes = [s for s in shapes if shape_matches(s, args.shapes)]
        peers = fwd_peers if section == "fwd" else bwd_peers[section]
        plan = Plan(shapes, peers, [section])
        with Progress(plan.timings, section) as prog:
            run_plan(plan, res, prog, timer, device, dtype)
        recs = [r for r in res.records if r["section"] == section]
        names = [p.name for p in peers if any(r["name"] == p.name and r["value"] for r in recs)]
        missing = {p.name: next((r["note"] for r in recs if r["name"] == p.name), None)
                   for p in peers if p.name not in names}
        print_table(pivot(recs, section, names), names, sol)
        if missing:
            print("not timed: " + "; ".join(f"{n} ({why})" for n, why in missing.items()))
    if "decode" in sections:
        run_decode(res, quick=args.quick)


def run_sweep(args, res, device, dtype, timer, out_dir) -> None:
    from solattn.bench import plots, sweep
    from solattn.bench.peers import SWEEP_DEFAULT
    from solattn.bench.progress import Progress

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
    from solattn.bench import sweep

    shapes = sweep.sweep_shapes(sweep.QUICK_SEQLENS, sweep.QUICK_HEAD_DIMS,
                                patterns=args.shapes)
    return sweep.Plan(shapes, plan.peers, plan.directions)


def run_decode(res, quick: bool = False) -> None:
    """Decode steps: GB/s = bytes of K and V read / time (CUDA-graph medians), and % of the
    HBM read ceiling measured in the same run."""
    from solattn.bench.core import read_gbps, time_graph_ms
    from solattn.bench.peers import DECODE_PEERS
    from solattn.bench.results import make_record

    ceiling = read_gbps()
    res.set("read_ceiling_gbps", ceiling)
    print(f"\nHBM read ceiling (bf16 sum over 1 GiB): {ceiling:.0f} GB/s")
    names = list(DECODE_PEERS)
    print("| decode shape | s_q | " + " | ".join(names) + " | solattn / ceiling | / cuDNN |")
    print("|" + "---|" * (len(names) + 4))
    for b, h, h_kv, L, d in DECODE_SHAPES:
        kc = torch.randn(b, L, h_kv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * kc.element_size()
        for s_q in (1,) if quick else (1, 4):
            q = torch.randn(b, s_q, h, d, device="cuda", dtype=torch.bfloat16)
            label = f"B{b} Hq{h} Hkv{h_kv} L{L} D{d} s_q{s_q}"
            row = {}
            for name in names:
                fn = DECODE_PEERS[name](q, kc, vc, seqlens)
                ms = time_graph_ms(fn) if fn is not None else None
                row[name] = nbytes / ms / 1e6 if ms else None
                res.add(make_record("decode", name, label, ms=ms, value=row[name], unit="GB/s",
                                    note=None if fn else "does not run this shape"))
            cells = [f"{row[n]:.0f}" if row[n] else "-" for n in names]
            pct = f"{100 * row['solattn'] / ceiling:.0f}%" if row["solattn"] else "-"
            vs = f"{row['solattn'] / row['cudnn']:.2f}x" if row["solattn"] and row["cudnn"] else "-"
            print(f"| B{b} Hq{h} Hkv{h_kv} L{L} D{d} | {s_q} | " + " | ".join(cells)
                  + f" | {pct} | {vs} |")
        del kc, vc
        torch.cuda.empty_cache()


def verify_in_interpreter() -> int:
    """``solattn bench`` without a GPU (kept for callers of the old entry point)."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args([]))
