"""``solattn bench``: verify against the reference, then time solattn and its peers.

On a CUDA GPU: checks a few shapes of every solattn backend against the float64 oracle, measures
the run's speed of light (bf16 matmul), and prints TFLOP/s per peer with ratios to cuDNN for the
forward and the backward (backward only, 2.5x the forward's FLOPs), then decode steps in GB/s
against the HBM read ceiling measured in the same run. Without
a GPU: runs the portable kernel in Triton's interpreter on small shapes, checks it against the
oracle, and says that timings need a GPU.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from solattn.bench.core import Shape, attn_flops, make_inputs, matmul_tflops, time_ms

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
VERIFY_SHAPES = [
    Shape(1, 4, 257, 1000, 128, causal=True),
    Shape(2, 4, 1000, 1000, 64, h_kv=2),
    Shape(1, 2, 333, 333, 256),
]


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="three shapes instead of the full list")
    p.add_argument(
        "--peers",
        default=None,
        help="comma-separated peers (default: all available); see solattn.bench.peers",
    )
    p.add_argument("--json", default=None, help="also write results to this JSON file")
    p.add_argument("--no-verify", action="store_true", help="skip the correctness check")
    p.add_argument(
        "--sections",
        default="fwd,bwd,decode",
        help="comma-separated subset of fwd,bwd,decode (default: all)",
    )


def verify(shapes, dtype, backends) -> bool:
    """Each backend on each shape against the float64 oracle (flash-attn's 2x rule)."""
    from solattn.bench.peers import run_solattn
    from solattn.reference import attention_ref

    ok = True
    for shape in shapes:
        x = make_inputs(shape, dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
        ref, _ = attention_ref(x.q, x.k, x.v, causal=shape.causal)
        ref_lo, _ = attention_ref(x.q, x.k, x.v, causal=shape.causal, upcast=False)
        base = (ref_lo.double() - ref).abs().max().item()
        for backend in backends:
            try:
                out = run_solattn(shape, x, backend)
            except NotImplementedError as exc:
                print(f"  verify {backend:<9} {shape.label():<34} skipped ({exc})")
                continue
            err = (out.double() - ref).abs().max().item()
            good = err <= 2 * base + 1e-5
            ok &= good
            print(
                f"  verify {backend:<9} {shape.label():<34} max err {err:.2e} "
                f"(PyTorch {dtype} {base:.2e}) {'ok' if good else 'FAIL'}"
            )
    return ok


def verify_in_interpreter() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("no CUDA GPU: set TRITON_INTERPRET=1 to verify the kernels in Triton's interpreter")
        return 1
    print(
        "No CUDA GPU: verifying the portable kernel in Triton's interpreter (fp16, small shapes)."
    )
    shapes = [
        Shape(1, 2, 33, 47, 64, causal=True),
        Shape(2, 4, 40, 40, 32, h_kv=2),
        Shape(1, 2, 17, 17, 40, d_v=24),
    ]
    ok = verify(shapes, torch.float16, ["portable"])
    print("verification " + ("passed" if ok else "FAILED"))
    print("Timings need a CUDA GPU: run `make bench` on a machine with one.")
    return 0 if ok else 1


def run(args) -> int:
    if not torch.cuda.is_available():
        return verify_in_interpreter()
    from solattn.bench.peers import FORWARD_PEERS

    names = args.peers.split(",") if args.peers else list(FORWARD_PEERS)
    unknown = set(names) - set(FORWARD_PEERS)
    if unknown:
        print(f"--peers: unknown {sorted(unknown)}; known: {list(FORWARD_PEERS)}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    import triton

    print(
        f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )
    ok = True
    if not args.no_verify:
        backends = [n.split("-")[1] for n in names if n.startswith("solattn-")]
        ok = verify(VERIFY_SHAPES, torch.bfloat16, backends)
    sections = args.sections.split(",")
    sol = matmul_tflops()
    print(f"speed of light: bf16 8192^3 matmul {sol:.0f} TFLOP/s")
    results = {"device": props.name, "sol_tflops": sol}
    if "fwd" in sections:
        shapes = QUICK_SHAPES if args.quick else FORWARD_SHAPES
        rows = _time_rows(shapes, FORWARD_PEERS, names, "fwd", backward=False)
        print_table(rows, names, sol)
        results["fwd"] = rows
    if "bwd" in sections:
        from solattn.bench.peers import BACKWARD_PEERS

        shapes = BACKWARD_SHAPES[:2] if args.quick else BACKWARD_SHAPES
        rows = _time_rows(shapes, BACKWARD_PEERS, list(BACKWARD_PEERS), "bwd", backward=True)
        print_table(rows, list(BACKWARD_PEERS), sol)
        results["bwd"] = rows
    if "decode" in sections:
        results["decode"] = run_decode(quick=args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


def _time_rows(shapes, peers, names, kind, backward):
    rows = []
    for shape in shapes:
        x = make_inputs(shape)
        row = {"shape": shape.label(), "kind": kind}
        for name in names:
            fn = peers[name](shape, x)
            row[name] = None if fn is None else attn_flops(shape, backward) / time_ms(fn) / 1e9
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows


def run_decode(quick: bool = False):
    """Decode steps: GB/s = bytes of K and V read / time (CUDA-graph medians), and % of the
    HBM read ceiling measured in the same run."""
    from solattn.bench.core import read_gbps, time_graph_ms
    from solattn.bench.peers import DECODE_PEERS

    ceiling = read_gbps()
    print(f"HBM read ceiling (bf16 sum over 1 GiB): {ceiling:.0f} GB/s")
    names = list(DECODE_PEERS)
    print("| decode shape | s_q | " + " | ".join(names) + " | solattn / ceiling | / cuDNN |")
    print("|" + "---|" * (len(names) + 4))
    rows = []
    for b, h, h_kv, L, d in DECODE_SHAPES:
        kc = torch.randn(b, L, h_kv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * kc.element_size()
        for s_q in (1,) if quick else (1, 4):
            q = torch.randn(b, s_q, h, d, device="cuda", dtype=torch.bfloat16)
            row = {"shape": f"B{b} Hq{h} Hkv{h_kv} L{L} D{d}", "s_q": s_q}
            for name in names:
                fn = DECODE_PEERS[name](q, kc, vc, seqlens)
                row[name] = None if fn is None else nbytes / time_graph_ms(fn) / 1e6
            rows.append(row)
            cells = [f"{row[n]:.0f}" if row[n] else "-" for n in names]
            pct = f"{100 * row['solattn'] / ceiling:.0f}%"
            vs = f"{row['solattn'] / row['cudnn']:.2f}x" if row.get("cudnn") else "-"
            print(f"| {row['shape']} | {s_q} | " + " | ".join(cells) + f" | {pct} | {vs} |")
        del kc, vc
        torch.cuda.empty_cache()
    return {"read_ceiling_gbps": ceiling, "rows": rows}


def print_table(rows, names, sol) -> None:
    """Markdown table: TFLOP/s per peer, best solattn as % of SOL and as a ratio to cuDNN."""
    head = "| shape | " + " | ".join(names) + " | best solattn / SOL | / cuDNN |"
    print()
    print(head)
    print("|" + "---|" * (len(names) + 3))
    for r in rows:
        cells = [f"{r[n]:.0f}" if r.get(n) else "-" for n in names]
        ours = [r[n] for n in names if n.startswith("solattn") and r.get(n)]
        best = max(ours) if ours else None
        sol_pct = f"{100 * best / sol:.0f}%" if best else "-"
        vs = f"{best / r['cudnn']:.2f}x" if best and r.get("cudnn") else "-"
        print(f"| {r['shape']} {r['kind']} | " + " | ".join(cells) + f" | {sol_pct} | {vs} |")
