"""``solattn`` command line: ``bench`` (verify + time: anchors, ``--ladder``, ``--sweep``), ``aot``
(compile every kernel, no GPU), ``warmup`` (fill Triton's cache for the common calls)."""

from __future__ import annotations

import argparse
import sys


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _head_dims(text: str) -> list[int]:
    from solattn.validation import MAX_HEAD_DIM

    dims = _int_list(text)
    bad = [d for d in dims if not 1 <= d <= MAX_HEAD_DIM]
    if bad:
        raise argparse.ArgumentTypeError(f"expected head dims in [1, {MAX_HEAD_DIM}], got {bad}")
    return dims


def _archs(text: str) -> list[int]:
    archs = _int_list(text)
    bad = [a for a in archs if a < 70]
    if bad:
        raise argparse.ArgumentTypeError(
            f"expected compute capabilities as integers >= 70 (90 for sm_90), got {bad}")
    return archs


def _dtypes(text: str) -> list[str]:
    from solattn.warmup import DTYPES

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated dtypes from {sorted(DTYPES)}, got {text!r}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="solattn", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_aot = sub.add_parser("aot", help="compile every kernel config for an arch; report SASS")
    p_aot.add_argument(
        "--arch",
        type=int,
        action="append",
        default=None,
        help="compute capability, e.g. 90 (repeatable; default 90)",
    )
    p_aot.add_argument("--only", default=None, help="only kernels whose name contains this")
    p_aot.add_argument("--jobs", type=int, default=None,
                       help="parallel compile processes (default: CPU count)")
    from solattn.warmup import DEFAULT_DTYPES, DEFAULT_HEAD_DIMS

    p_warm = sub.add_parser(
        "warmup", help="compile the common kernels into Triton's cache (first calls load them)",
        description="Compile the kernels of flash_attn_func's common calls (forward and "
        "backward, causal and not) into Triton's on-disk cache (TRITON_CACHE_DIR, default "
        "~/.triton/cache), in parallel, so that the first call of a new process loads them "
        "instead of compiling. No GPU needed with --arch.")
    p_warm.add_argument("--arch", type=_archs, default=None,
                        help="compute capabilities to compile for, e.g. 90 or 80,90 "
                             "(default: the visible GPU's)")
    p_warm.add_argument("--head-dims", type=_head_dims, default=list(DEFAULT_HEAD_DIMS),
                        help="comma-separated head dims (default: %(default)s)")
    p_warm.add_argument("--dtypes", type=_dtypes, default=list(DEFAULT_DTYPES),
                        help="comma-separated, from bf16,fp16 (default: %(default)s)")
    p_warm.add_argument("--no-gqa", action="store_true",
                        help="skip the GQA/MQA kernels (nheads_kv < nheads)")
    p_warm.add_argument("--varlen", action="store_true",
                        help="also flash_attn_varlen_func's kernels")
    p_warm.add_argument("--kvcache", action="store_true",
                        help="also flash_attn_with_kvcache's decode-step kernels")
    p_warm.add_argument("--only", default=None, help="only kernels whose label contains this")
    p_warm.add_argument("--list", action="store_true", help="list the kernels, compile nothing")
    p_warm.add_argument("--jobs", type=int, default=None,
                        help="parallel compile processes (default: CPU count)")
    from solattn.bench.cli import __doc__ as bench_doc
    from solattn.bench.cli import add_arguments

    p_bench = sub.add_parser("bench", help="verify against the reference and print TFLOP/s",
                             description=bench_doc,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p_bench)
    args = parser.parse_args(argv)
    if args.cmd == "warmup":
        from solattn.warmup import run as run_warmup

        if args.jobs is not None and args.jobs < 1:
            parser.error(f"--jobs: expected a positive integer, got {args.jobs}")
        try:
            return run_warmup(args.arch, head_dims=args.head_dims, dtypes=args.dtypes,
                              gqa=not args.no_gqa, varlen=args.varlen,
                              kvcache=args.kvcache, only=args.only,
                              list_only=args.list, jobs=args.jobs)
        except (ValueError, RuntimeError) as exc:
            parser.error(str(exc))
    if args.cmd == "aot":
        from solattn.aot import run

        return run(args.arch or [90], only=args.only, jobs=args.jobs)
    from solattn.bench.cli import run as run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
