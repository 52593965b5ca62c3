"""``solattn`` command line: ``bench`` (verify + time: anchors, ``--ladder``, ``--sweep``), ``aot``
(compile every kernel, no GPU)."""

from __future__ import annotations

import argparse
import sys


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
    from solattn.bench.cli import __doc__ as bench_doc
    from solattn.bench.cli import add_arguments

    p_bench = sub.add_parser("bench", help="verify against the reference and print TFLOP/s",
                             description=bench_doc,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p_bench)
    args = parser.parse_args(argv)
    if args.cmd == "aot":
        from solattn.aot import run

        return run(args.arch or [90], only=args.only, jobs=args.jobs)
    from solattn.bench.cli import run as run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
