"""solattn.flex against torch's compiled flex_attention: same mods, same inputs, same run.

    python3 scripts/bench_flex.py                          # L 4096 and 16384, d 128, all mods
    python3 scripts/bench_flex.py --lengths 4096 --mods causal,document
    python3 scripts/bench_flex.py --cbm-only --device cpu  # create_block_mask timing only

Per sequence length and mod: create_block_mask time (solattn's vs torch's, eager), forward and
backward time of both flex_attentions (median of ``triton.testing.do_bench``, after a check that
the two agree), and the first-call latency of a never-seen mod (solattn: trace + codegen + Triton
compile; torch: Dynamo + Inductor). TFLOP/s count the FLOPs of the blocks the BlockMask lists
(4 B H L^2 d x block density forward, 2.5x that backward), the convention of torch's flex
benchmarks. Mods with a dedicated kernel (causal, sliding window, ALiBi, softcap) are also
timed through ``flash_attn_func`` on the same tensors: "vs dedicated" is the flex call's speed
relative to it (the issue's >= 0.9x). The forwards are also timed as CUDA-graph replays without
autograd ("GPU time"): a short call whose host path takes about as long as its kernel plus
``do_bench``'s L2 flush reads its host time or its kernel's in ``do_bench``, whichever the CPU
makes longer at that moment (BENCHMARKS.md, ninth session). Results go to
``$OUT/bench_flex.json`` and ``$OUT/bench_flex.txt`` (``$OUT`` or ``--out``, default
``./bench_flex_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from solattn import flash_attn_func
from solattn.flex import create_block_mask, flex_attention
from solattn.flex import examples as ex

# name -> (score_mod factory or None, mask factory); factories take (L, H, B, device)
WINDOW = 1024


def _doc_ids(L, device, n_docs=16):
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(L - 1, generator=g)[: n_docs - 1] + 1).values
    ids = torch.zeros(L, dtype=torch.int32)
    ids[cuts] = 1
    return torch.cumsum(ids, 0).to(torch.int32).to(device)


def _slopes(H, device):
    return torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)


def catalogue(L, H, B, device):
    slopes = _slopes(H, device)
    table = (torch.randn(H, 2 * L - 1, device=device) * 0.1).requires_grad_()
    prefix = torch.full((B,), L // 4, device=device, dtype=torch.int32)
    return {
        "causal": (None, ex.causal),
        "sliding_window": (None, ex.sliding_window(WINDOW)),
        "document": (None, ex.document_causal(_doc_ids(L, device))),
        "prefix_lm": (None, ex.prefix_lm(prefix)),
        "alibi": (ex.alibi(slopes), ex.causal),
        "softcap": (ex.softcap(30.0), ex.causal),
        "relative_bias": (ex.relative_bias(table, L), ex.causal),
    }


def dedicated(name, H, device):
    """``flash_attn_func`` keywords of the dedicated kernel computing catalogue mod ``name``
    (the same attention: causal, a causal window of WINDOW keys back, ALiBi or softcap over
    causal), or None where there is none."""
    return {"causal": dict(causal=True),
            "sliding_window": dict(causal=True, window_size=(WINDOW, 0)),
            "alibi": dict(causal=True, alibi_slopes=_slopes(H, device)),
            "softcap": dict(causal=True, softcap=30.0)}.get(name)


def timed(fn, reps=3):
    """Median wall-clock ms of ``fn()`` (synchronized), after one untimed call."""
    fn()
    out = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out)[len(out) // 2]


def bench_create_block_mask(args, device):
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

    rows = []
    for L in args.cbm_lengths:
        for name in ("causal", "document"):
            mask = catalogue(L, 1, 1, device)[name][1]
            row = {"L": L, "mask": name, "device": str(device)}
            row["solattn_ms"] = timed(lambda: create_block_mask(mask, None, None, L, L,
                                                                device=device), reps=args.reps)
            # torch's eager create_block_mask materializes the L x L mask: skip where it cannot
            # fit (bool L^2 bytes plus int64 temporaries)
            if L * L * 10 < args.torch_cbm_bytes:
                row["torch_ms"] = timed(lambda: torch_cbm(mask, None, None, L, L,
                                                          device=device), reps=args.reps)
            rows.append(row)
            print(f"create_block_mask L={L:<6} {name:<9} {device}: solattn "
                  f"{row['solattn_ms']:.1f} ms, torch "
                  f"{row.get('torch_ms', float('nan')):.1f} ms", flush=True)
    return rows


def _fresh_softcap():
    """A mod never seen before: a new code object with a new constant (new graph, new generated
    code, new Triton compile for solattn; a Dynamo recompile and an Inductor kernel for torch)."""
    cap = 20.0 + random.random()
    scope = {"torch": torch}
    exec(f"def fresh_softcap(score, b, h, q_idx, kv_idx):\n"  # noqa: S102 - our own source
         f"    return {cap!r} * torch.tanh(score / {cap!r})\n", scope)
    return scope["fresh_softcap"]


def bench_attention(args):
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from solattn.bench.core import env_info, header_lines, time_graph_ms, time_ms

    # one compiled flex_attention sees every mod: let Dynamo keep a graph per mod
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    # softcap's Python-float cap stays a constant (else torch 2.11's flex cannot compile it)
    torch._dynamo.config.specialize_float = True
    # the backward is timed by repeated autograd.grad(retain_graph=True) over one graph, which a
    # compiled backward with donated buffers refuses
    torch._functorch.config.donated_buffer = False
    torch_flex_c = torch.compile(torch_flex, dynamic=False)
    # which kernels ran solattn's forward and backward: count the Hopper flex kernels' launches
    from solattn.kernels.hopper import flex_backward as hopper_flex_bwd
    from solattn.kernels.hopper import flex_forward as hopper_flex

    hopper_calls = {"fwd": 0, "bwd": 0}

    def counted(module, name, which):
        launch = getattr(module, name)

        def run(*a, **kw):
            hopper_calls[which] += 1
            return launch(*a, **kw)
        setattr(module, name, run)

    counted(hopper_flex, "attn_fwd_flex", "fwd")
    counted(hopper_flex_bwd, "attn_bwd_flex", "bwd")
    if args.portable:
        os.environ["SOLATTN_BACKEND"] = "portable"
    info = env_info()
    rows = []
    for L in args.lengths:
        B = max(1, args.tokens // L)
        H, D = args.heads, args.dim
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for name, (score_mod, mask_mod) in catalogue(L, H, B, "cuda").items():
            if args.mods and name not in args.mods:
                continue
            row = {"L": L, "B": B, "H": H, "D": D, "mod": name}
            # masks that do not depend on the batch/head broadcast over them (B/H = None), as
            # users write them (torch's eager create_block_mask materializes B H L^2 otherwise)
            bb = B if name == "prefix_lm" else None
            bm = create_block_mask(mask_mod, bb, None, L, L, device="cuda")
            tbm = torch_cbm(mask_mod, bb, None, L, L, device="cuda")
            row["cbm_solattn_ms"] = timed(lambda: create_block_mask(mask_mod, bb, None, L, L,
                                                                    device="cuda"))
            row["cbm_torch_ms"] = timed(lambda: torch_cbm(mask_mod, bb, None, L, L,
                                                          device="cuda"))
            density = 1 - bm.sparsity() / 100
            fwd_flops = 4 * B * H * L * L * D * density
            leaves = [q, k, v] + ([c.cell_contents for c in score_mod.__closure__ or ()
                                   if isinstance(c.cell_contents, torch.Tensor)
                                   and c.cell_contents.requires_grad] if score_mod else [])
            outs = {}
            hopper_calls.update(fwd=0, bwd=0)
            for lib, fn, mask in (("solattn", flex_attention, bm), ("torch", torch_flex_c, tbm)):
                run = (lambda fn=fn, mask=mask: fn(q, k, v, score_mod=score_mod,
                                                   block_mask=mask))
                try:
                    out = run()
                    grads = torch.autograd.grad(out, leaves, dout)
                except Exception as exc:  # e.g. torch's own flex kernel out of shared memory
                    if lib == "solattn":
                        raise
                    row["torch_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:160]}"
                    print(f"L={L:<6} {name:<15} torch's flex_attention failed: "
                          f"{row['torch_error']}", flush=True)
                    break
                outs[lib] = [out] + list(grads)
                ms = time_ms(run)
                out = run()
                bwd_ms = time_ms(lambda out=out: torch.autograd.grad(out, leaves, dout,
                                                                     retain_graph=True))
                row[f"{lib}_fwd_ms"], row[f"{lib}_bwd_ms"] = ms, bwd_ms
                row[f"{lib}_fwd_tflops"] = fwd_flops / ms / 1e9
                row[f"{lib}_bwd_tflops"] = 2.5 * fwd_flops / bwd_ms / 1e9
                try:  # the forward's GPU time: CUDA-graph replays, no host path, no autograd
                    with torch.no_grad():
                        row[f"{lib}_fwd_graph_ms"] = time_graph_ms(run)
                    row[f"{lib}_fwd_graph_tflops"] = (fwd_flops / row[f"{lib}_fwd_graph_ms"]
                                                      / 1e9)
                except Exception as exc:  # a kernel or library that cannot be captured
                    row[f"{lib}_graph_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            kwargs = dedicated(name, H, "cuda")
            if kwargs is not None and "torch_error" not in row:
                # The same inputs through flash_attn_func's (b, s, h, d) views: its dedicated
                # kernels (Hopper forward and backward where they cover the call).
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                run = (lambda: flash_attn_func(qt, kt, vt, **kwargs))
                out = run()
                outs["dedicated"] = [out.transpose(1, 2)] + list(
                    torch.autograd.grad(out, [q, k, v], dout.transpose(1, 2)))
                row["dedicated_fwd_ms"] = time_ms(run)
                out = run()
                row["dedicated_bwd_ms"] = time_ms(
                    lambda out=out: torch.autograd.grad(out, [q, k, v], dout.transpose(1, 2),
                                                        retain_graph=True))
                row["dedicated_max_abs_diff"] = [
                    float((a.detach().float() - b.detach().float()).abs().max())
                    for a, b in zip(outs["solattn"], outs["dedicated"])]
            row["block_density"] = density
            row["solattn_fwd_kernel"] = "hopper" if hopper_calls["fwd"] else "portable"
            row["solattn_bwd_kernel"] = "hopper" if hopper_calls["bwd"] else "portable"
            rows.append(row)
            if "torch" not in outs:
                print(f"L={L:<6} {name:<15} fwd {row['solattn_fwd_tflops']:6.1f} TFLOP/s  bwd "
                      f"{row['solattn_bwd_tflops']:6.1f} (no torch row)", flush=True)
                continue
            row["max_abs_diff"] = [float((a.detach().float() - b.detach().float()).abs().max())
                                   for a, b in zip(outs["solattn"], outs["torch"])]
            print(f"L={L:<6} {name:<15} fwd {row['solattn_fwd_tflops']:6.1f} vs "
                  f"{row['torch_fwd_tflops']:6.1f} TFLOP/s  bwd {row['solattn_bwd_tflops']:6.1f} "
                  f"vs {row['torch_bwd_tflops']:6.1f}  cbm {row['cbm_solattn_ms']:.2f} vs "
                  f"{row['cbm_torch_ms']:.2f} ms  diff {max(row['max_abs_diff']):.3g}"
                  f"{_graph_text(row)}{_dedicated_text(row)}", flush=True)
    # first call of a never-seen mod (L = the first length, forward then backward)
    L = args.lengths[0]
    B = max(1, args.tokens // L)
    q, k, v = (torch.randn(B, args.heads, L, args.dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    bm = create_block_mask(ex.causal, None, None, L, L, device="cuda")
    tbm = torch_cbm(ex.causal, None, None, L, L, device="cuda")
    first = {}
    for lib, fn, mask in (("solattn", flex_attention, bm), ("torch", torch_flex_c, tbm)):
        mod = _fresh_softcap()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(q, k, v, score_mod=mod, block_mask=mask)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out.float().sum().backward()
        torch.cuda.synchronize()
        first[lib] = {"fwd_s": t1 - t0, "fwd_bwd_s": time.perf_counter() - t0}
        print(f"first call of a new score_mod, {lib}: forward {first[lib]['fwd_s']:.2f} s, "
              f"forward+backward {first[lib]['fwd_bwd_s']:.2f} s", flush=True)
    return info, header_lines(info), rows, first


def _graph_text(r: dict) -> str:
    """The forwards' GPU time (CUDA graph) where both were captured."""
    if "solattn_fwd_graph_tflops" not in r or "torch_fwd_graph_tflops" not in r:
        return ""
    return (f"  fwd GPU time (CUDA graph) {r['solattn_fwd_graph_tflops']:.0f} vs "
            f"{r['torch_fwd_graph_tflops']:.0f} TF/s")


def _dedicated_text(r: dict) -> str:
    """The dedicated kernel's times as ratios: solattn's flex speed / the dedicated kernel's."""
    if "dedicated_fwd_ms" not in r:
        return ""
    fwd = r["dedicated_fwd_ms"] / r["solattn_fwd_ms"]
    return (f"  vs dedicated flash_attn_func: fwd {fwd:.2f}x"
            f" bwd {r['dedicated_bwd_ms'] / r['solattn_bwd_ms']:.2f}x (diff "
            f"{max(r['dedicated_max_abs_diff']):.3g})")


def _row_line(r: dict) -> str:
    head = (f"L={r['L']} B={r['B']} H={r['H']} D={r['D']} {r['mod']:<15} "
            f"[{r.get('solattn_fwd_kernel', '?')}/{r.get('solattn_bwd_kernel', '?')}] fwd "
            f"{r['solattn_fwd_ms']:.3f} ms "
            f"({r['solattn_fwd_tflops']:.0f} TF/s)")
    if "torch_error" in r:
        return (f"{head}  bwd {r['solattn_bwd_ms']:.3f} ms ({r['solattn_bwd_tflops']:.0f}); "
                f"torch failed: {r['torch_error']}")
    return (f"{head} vs torch {r['torch_fwd_ms']:.3f} ms ({r['torch_fwd_tflops']:.0f})  bwd "
            f"{r['solattn_bwd_ms']:.3f} ms ({r['solattn_bwd_tflops']:.0f}) vs torch "
            f"{r['torch_bwd_ms']:.3f} ms ({r['torch_bwd_tflops']:.0f})  create_block_mask "
            f"{r['cbm_solattn_ms']:.2f} vs {r['cbm_torch_ms']:.2f} ms  max|diff| "
            f"{max(r['max_abs_diff']):.3g}{_graph_text(r)}{_dedicated_text(r)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // L")
    p.add_argument("--mods", default="", help="comma-separated subset of the catalogue")
    p.add_argument("--cbm-only", action="store_true", help="only time create_block_mask")
    p.add_argument("--cbm-lengths", default="16384,131072")
    p.add_argument("--torch-cbm-bytes", type=float, default=8e9,
                   help="skip torch's create_block_mask when ~10 L^2 bytes exceed this")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--portable", action="store_true",
                   help="run solattn's flex forward and backward on the portable kernels also "
                        "where the Hopper flex kernels apply (SOLATTN_BACKEND=portable)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_flex_out"))
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.cbm_lengths = [int(x) for x in args.cbm_lengths.split(",")]
    args.mods = [m for m in args.mods.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    result = {"argv": " ".join(sys.argv)}
    result["create_block_mask"] = bench_create_block_mask(args, torch.device(args.device))
    lines = [f"create_block_mask L={r['L']} {r['mask']} on {r['device']}: solattn "
             f"{r['solattn_ms']:.1f} ms, torch {r.get('torch_ms', float('nan')):.1f} ms"
             for r in result["create_block_mask"]]
    if not args.cbm_only:
        if not torch.cuda.is_available():
            print("bench_flex: attention timings need a CUDA GPU (use --cbm-only on the CPU)")
            return 1
        info, header, rows, first = bench_attention(args)
        result.update(info=info, attention=rows, first_call=first)
        lines = header + lines + [_row_line(r) for r in rows] + [
            f"first call, new score_mod ({lib}): forward {f['fwd_s']:.2f} s, forward+backward "
            f"{f['fwd_bwd_s']:.2f} s" for lib, f in first.items()]
    with open(os.path.join(args.out, "bench_flex.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, "bench_flex.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
