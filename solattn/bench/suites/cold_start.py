"""``cold-start``: the first calls of a fresh process, forward and backward of
``flash_attn_func`` per case, and what Triton did for them (kernels compiled or loaded from its
on-disk cache).

Each case list runs twice in new processes sharing one new, empty ``TRITON_CACHE_DIR``: "cold"
(everything compiles) then "cached" (everything should load; what a user sees after ``solattn
warmup``). Each time is one synchronized call, the first of its kind in its process. CUDA's
context and torch's own first backward (timed and printed: torch's one-time autograd set-up,
~2 s on an H100 host when given a gradient tensor) come before the first case.

The child process: ``python -m solattn.bench.suites.cold_start CASES B,L,H`` prints one JSON
line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

# dtype:head_dim:causal|full (flash_attn_func), decode (a flash_attn_with_kvcache step, B1 Hq32
# Hkv8 d128, 4096 cached keys, append), flex:MASK (a FlexAttention call, B4 H16 L4096 d128:
# MASK documents = 16 causal documents, softcap = a softcap score_mod over causal).
CASES = "bf16:128:causal,bf16:128:full,bf16:64:causal,decode,flex:documents,flex:softcap"
SHAPE = "1,1024,8"
CPU_CASES = "fp16:32:causal,decode"
CPU_SHAPE = "1,40,2"


def child(cases: str, shape: str) -> dict:
    """Run in a fresh process: first-call seconds per case and direction, and kernel counts."""
    import torch
    from triton import knobs

    import solattn

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    events: list = []  # (kernel, loaded from the cache)
    knobs.compilation.listener = lambda *, src, cache_hit, **_: events.append(
        (src.name, cache_hit))
    torch.ones(1, device=device).add_(1)
    sync()
    t0 = time.perf_counter()
    x = torch.ones(4, device=device, requires_grad=True)
    (x * 2).backward(torch.ones_like(x))
    sync()
    report = {"torch_first_backward_s": time.perf_counter() - t0, "cases": {}}
    b, n, h = (int(v) for v in shape.split(","))
    for case in cases.split(","):
        if case == "decode" or case.startswith("flex:"):
            fwd, bwd = _decode_call(device) if case == "decode" else _flex_call(case, device)
            row = {}
            for step, fn in (("fwd", fwd), ("bwd", bwd)):
                if fn is None:
                    continue
                del events[:]
                t0 = time.perf_counter()
                fn()
                sync()
                row[step] = {"s": time.perf_counter() - t0,
                             "compiled": sum(1 for _, hit in events if not hit),
                             "loaded": sum(1 for _, hit in events if hit)}
            report["cases"][case] = row
            continue
        name, d, mode = case.split(":")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
        q, k, v = (torch.randn(b, n, h, int(d), device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(b, n, h, int(d), device=device, dtype=dtype)
        row = {}
        for step in ("fwd", "bwd"):
            del events[:]
            t0 = time.perf_counter()
            if step == "fwd":
                out = solattn.flash_attn_func(q, k, v, causal=mode == "causal")
            else:
                out.backward(dout)
            sync()
            row[step] = {"s": time.perf_counter() - t0,
                         "compiled": sum(1 for _, hit in events if not hit),
                         "loaded": sum(1 for _, hit in events if hit)}
        report["cases"][case] = row
    return report


def _decode_call(device):
    """A decode step appending one token to a 4096-token cache (no backward)."""
    import torch

    import solattn

    dt = torch.bfloat16 if device == "cuda" else torch.float16
    L, d = (8192, 128) if device == "cuda" else (64, 32)
    kc, vc = (torch.randn(1, L, 8, d, device=device, dtype=dt) for _ in range(2))
    q = torch.randn(1, 1, 32, d, device=device, dtype=dt)
    k, v = (torch.randn(1, 1, 8, d, device=device, dtype=dt) for _ in range(2))
    lens = torch.full((1,), L // 2, dtype=torch.int32, device=device)
    return (lambda: solattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                    causal=True)), None


def _flex_call(case: str, device):
    """The first FlexAttention forward (inputs requiring grad) and then its backward."""
    import torch

    from solattn.flex import create_block_mask, flex_attention
    from solattn.flex import examples as ex

    B, H, L, D = (4, 16, 4096, 128) if device == "cuda" else (1, 2, 64, 32)
    dt = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dt, requires_grad=True)
               for _ in range(3))
    mask = case.split(":", 1)[1]
    if mask == "documents":
        ids = (torch.arange(L, device=device) * 16 // L).to(torch.int32)
        score_mod, mask_mod = None, ex.document_causal(ids)
    elif mask == "softcap":
        score_mod, mask_mod = ex.softcap(30.0), ex.causal
    else:
        raise ValueError(f"cold-start: unknown flex case {case!r} (documents, softcap)")
    bm = create_block_mask(mask_mod, None, None, L, L, device=device,
                           **({} if device == "cuda" else {"BLOCK_SIZE": 16}))
    out = []

    def fwd():
        out.append(flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))

    def bwd():
        out[-1].float().sum().backward()

    return fwd, bwd


def _spawn(cases: str, shape: str, cache_dir: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    proc = subprocess.run([sys.executable, "-m", "solattn.bench.suites.cold_start", cases, shape],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"cold-start child failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(ctx, res, out=print) -> dict:
    from ..results import make_record

    cases, shape = (CPU_CASES, CPU_SHAPE) if ctx.cpu else (CASES, SHAPE)
    summary = {"rows": 0, "checked": [], "failed": [], "not_run": {}, "ran": set()}
    with tempfile.TemporaryDirectory(prefix="solattn-cold-") as cache:
        runs = {"cold": _spawn(cases, shape, cache), "cached": _spawn(cases, shape, cache)}
    b, n, h = shape.split(",")
    out("")
    out(f"first calls of a fresh process, B{b} L{n} H{h} (seconds; kernels compiled / loaded)")
    out("| case | cold fwd | cold bwd | cached fwd | cached bwd |")
    out("|---|---|---|---|---|")
    for case in cases.split(","):
        cells = []
        for kind in ("cold", "cached"):
            for step in ("fwd", "bwd"):
                r = runs[kind]["cases"][case].get(step)
                if r is None:  # a decode step has no backward
                    cells.append("-")
                    continue
                cells.append(f"{r['s']:.3f} ({r['compiled']}/{r['loaded']})")
                res.add(make_record(step, f"solattn-{kind}", f"{case} B{b} L{n} H{h}",
                                    ms=r["s"] * 1e3, value=r["s"], unit="s",
                                    compiled=r["compiled"], loaded=r["loaded"]))
        out(f"| {case} | " + " | ".join(cells) + " |")
        summary["rows"] += 1
        cached_compiles = sum(r["compiled"] for r in runs["cached"]["cases"][case].values())
        entry = f"cold-start: {case}: the cached run compiled {cached_compiles} kernel(s)"
        if ctx.cpu:
            entry = f"cold-start: {case}: ran in two fresh processes (the interpreter compiles " \
                    "nothing)"
        (summary["checked"] if cached_compiles == 0 else summary["failed"]).append(entry)
        summary["ran"].add("solattn")
    out(f"torch's own first backward: {runs['cold']['torch_first_backward_s']:.3f} s (cold), "
        f"{runs['cached']['torch_first_backward_s']:.3f} s (cached)")
    return summary


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
