"""Small Hopper-backward calls for compute-sanitizer memcheck (every feature the kernel covers).

    /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        python3 tools/hopper_bwd_sanitize.py [D ...] [--dropout]

(``D``: the head dims to run, default 64 128 256. ``--dropout``: only the calls with dropout,
forward and backward on the Hopper kernels' keep mask; beside softcap at d=128 the
64-key tile.)

Each case runs the Hopper backward through its launcher (the forward by the dispatcher) and
prints whether the gradients are finite; the sanitizer's summary says whether any access went
out of bounds (TMA tiles past a sequence, the padded per-row buffers, the dQ writer's atomics,
the deterministic mode's turn counters).
"""
import sys

import torch

from solattn import flash_attn_func, flash_attn_varlen_func
from solattn.core import make_params
from solattn.kernels.hopper.backward_plan import attn_bwd

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16


def run(name, q, k, v, fwd, **kw):
    out, lse = fwd(q, k, v, return_lse=True)
    p = make_params(q, k, **kw)
    grads = attn_bwd(torch.randn_like(out), q, k, v, out, lse, p)
    torch.cuda.synchronize()
    print(f"{name}: finite={all(bool(g.isfinite().all()) for g in grads)}", flush=True)


DROPOUT_ONLY = "--dropout" in sys.argv
for d in [int(a) for a in sys.argv[1:] if a != "--dropout"] or (64, 128, 256):
    q = torch.randn(2, 300, 4, d, device=dev, dtype=dt)
    k, v = (torch.randn(2, 333, 2, d, device=dev, dtype=dt) for _ in range(2))
    dropout = (dict(dropout_p=0.17, causal=True), dict(dropout_p=0.17, window_size=(100, 37)),
               dict(dropout_p=0.17, causal=True, softcap=5.0))
    plain = (dict(causal=True), dict(window_size=(100, 37), softcap=20.0),
             dict(causal=True, window_size=(64, -1), softcap=5.0),
             dict(causal=True, deterministic=True), dict(window_size=(100, 37),
                                                         deterministic=True))
    for kw in dropout if DROPOUT_ONLY else plain + dropout:
        run(f"d{d} {kw}", q, k, v, lambda q, k, v, kw=kw, **a: flash_attn_func(q, k, v, **kw, **a),
            **kw)
    lens_q, lens_k = [0, 120, 1, 64, 7], [4, 0, 190, 64, 300]
    cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 4, d, device=dev, dtype=dt)
    k, v = (torch.randn(sum(lens_k), 2, d, device=dev, dtype=dt) for _ in range(2))
    varlen_dropout = (dict(causal=True, dropout_p=0.17),
                      dict(causal=True, dropout_p=0.17, softcap=8.0))
    varlen_plain = (dict(causal=True), dict(window_size=(40, 7), softcap=8.0),
                    dict(causal=True, deterministic=True))
    for kw in varlen_dropout if DROPOUT_ONLY else varlen_plain + varlen_dropout:
        lens = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                    max_seqlen_k=max(lens_k))
        run(f"d{d} varlen {kw}", q, k, v,
            lambda q, k, v, kw=kw, **a: flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw, **a), **lens, **kw)
