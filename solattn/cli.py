"""The ``solattn`` command: ``bench``, ``aot`` and ``warmup``.

Run ``solattn COMMAND --help`` for the options of one command.
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
solattn: exact FlashAttention for PyTorch, written in Python (Triton and Gluon).
Run `solattn COMMAND --help` for the options of one command.
"""

AOT_DESCRIPTION = """\
Compile every kernel configuration solattn ships for the given GPU architectures, on this
machine (no GPU needed), and print one line per kernel: registers, spills, whether a spill
sits inside an inner loop, shared memory, and the tensor-core instructions used. Exits 1 when a
kernel fails to compile, spills inside a loop, needs more shared memory than the GPU gives a
block, or uses no tensor cores. Architectures: 80, 86, 89, 90, 100, 120 (80 and 90 compile
every kernel, the others a representative subset). Results are cached by the kernels' source
in $SOLATTN_CI_CACHE/aot (SOLATTN_AOT_CACHE=0: off).
"""

WARMUP_DESCRIPTION = """\
Compile the kernels of flash_attn_func's common calls (forward and backward, causal and not)
into Triton's on-disk cache (TRITON_CACHE_DIR, default ~/.triton/cache), in parallel, so that
the first call of a new process loads them instead of compiling. No GPU needed with --arch.
"""


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


def add_arch_argument(parser, default_text: str) -> None:
    """``--arch``: comma-separated and repeatable (``--arch 90,80`` = ``--arch 90 --arch 80``);
    every value is kept, in order, without duplicates (see :func:`unique`)."""
    parser.add_argument("--arch", type=_archs, action="extend", default=None, metavar="CC",
                        help="compute capabilities to compile for, e.g. 90 (sm_90) or 90,80; "
                             f"may be repeated (default: {default_text})")


def unique(values):
    """``values`` in first-seen order without repeats (None stays None)."""
    return None if values is None else list(dict.fromkeys(values))


def _version() -> str:
    import solattn

    return f"solattn {solattn.__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="solattn", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    p_aot = sub.add_parser("aot", help="compile every kernel for a GPU architecture (no GPU "
                                       "needed); report registers and spills",
                           description=AOT_DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arch_argument(p_aot, "90")
    p_aot.add_argument("--only", default=None, metavar="TEXT",
                       help="only the kernels whose name contains TEXT")
    p_aot.add_argument("--jobs", type=int, default=None,
                       help="parallel compile processes (default: the CPU count)")
    from solattn.warmup import DEFAULT_DTYPES, DEFAULT_HEAD_DIMS

    p_warm = sub.add_parser(
        "warmup", help="compile the common kernels into Triton's cache (first calls load them)",
        description=WARMUP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arch_argument(p_warm, "the visible GPU's")
    p_warm.add_argument("--head-dims", type=_head_dims, default=list(DEFAULT_HEAD_DIMS),
                        help="comma-separated head dims (default: %(default)s)")
    p_warm.add_argument("--dtypes", type=_dtypes, default=list(DEFAULT_DTYPES),
                        help="comma-separated, from bf16,fp16 (default: %(default)s)")
    p_warm.add_argument("--no-gqa", action="store_true",
                        help="skip the GQA/MQA kernels (fewer key/value heads than query heads)")
    p_warm.add_argument("--varlen", action="store_true",
                        help="also the kernels of flash_attn_varlen_func")
    p_warm.add_argument("--kvcache", action="store_true",
                        help="also the decode-step kernels of flash_attn_with_kvcache")
    p_warm.add_argument("--only", default=None, metavar="TEXT",
                        help="only the kernels whose label contains TEXT")
    p_warm.add_argument("--list", action="store_true", help="list the kernels, compile nothing")
    p_warm.add_argument("--jobs", type=int, default=None,
                        help="parallel compile processes (default: the CPU count)")
    from solattn.bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from solattn.bench.cli import add_arguments

    p_bench = sub.add_parser("bench", help="check the kernels, then time them beside other "
                                           "implementations (TFLOP/s, GB/s)",
                             description=BENCH_DESCRIPTION,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p_bench)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 0
    if args.cmd in ("aot", "warmup") and args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")
    archs = unique(args.arch) if args.cmd in ("aot", "warmup") else None
    if args.cmd == "warmup":
        from solattn.warmup import run as run_warmup

        try:
            return run_warmup(archs, head_dims=args.head_dims, dtypes=args.dtypes,
                              gqa=not args.no_gqa, varlen=args.varlen,
                              kvcache=args.kvcache, only=args.only,
                              list_only=args.list, jobs=args.jobs)
        except (ValueError, RuntimeError) as exc:
            parser.error(str(exc))
    if args.cmd == "aot":
        from solattn.aot import run

        return run(archs or [90], only=args.only, jobs=args.jobs)
    from solattn.bench.cli import run as run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
