"""The Hopper backward against the portable one, feature by feature, at one head dim.

    PYTHONPATH=$PWD python3 tools/bwd_features.py [--head-dim 256] [--rounds 3] [--only TEXT]

Per feature (ALiBi, softcap, windows, varlen, deterministic, dropout, GQA split, and their
combinations; bf16, B2 H8 L4096 unless the label says otherwise), one forward recorded through
``flash_attn_func`` / ``flash_attn_varlen_func`` on the default route (so that both backwards
see one output and one dropout mask), then the backward (``torch.autograd.grad``) forced onto
each backend and timed with ``triton.testing.do_bench``
(medians, warm-up 100 ms, rep 400 ms) in ``--rounds`` interleaved rounds after
``solattn.bench.core.warm_up`` of a matmul.
Before timing, each feature's gradients from the Hopper kernel are compared with the portable
kernel's (the largest absolute difference over dq, dk, dv is printed; exit 1 above 0.06, bf16
rounding at these sizes). FLOPs: 2.5 x 4 x the visible query-key pairs x D (causal, windows,
varlen). A feature the Hopper kernel does not take prints the reason ``covers`` gives.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

ALIBI = "alibi"
FEATURES = [  # label, keywords; "varlen": 12 sequences of 256-4096 tokens (seed 0)
    ("plain", {}),
    ("causal", dict(causal=True)),
    ("alibi", dict(alibi_slopes=ALIBI)),
    ("causal alibi", dict(causal=True, alibi_slopes=ALIBI)),
    ("causal softcap30", dict(causal=True, softcap=30.0)),
    ("causal window1024", dict(causal=True, window_size=(1024, 0))),
    ("window (1024,1024)", dict(window_size=(1024, 1024))),
    ("varlen", dict(varlen=True)),
    ("varlen causal", dict(varlen=True, causal=True)),
    ("varlen causal softcap50", dict(varlen=True, causal=True, softcap=50.0)),
    ("varlen causal alibi", dict(varlen=True, causal=True, alibi_slopes=ALIBI)),
    ("causal softcap30 alibi", dict(causal=True, softcap=30.0, alibi_slopes=ALIBI)),
    ("determ", dict(deterministic=True)),
    ("determ causal", dict(deterministic=True, causal=True)),
    ("determ window (1024,1024)", dict(deterministic=True, window_size=(1024, 1024))),
    ("gqa split causal (B1 Hq16 Hkv2 L2048)", dict(gqa=True, causal=True)),
    ("dropout0.1", dict(dropout_p=0.1)),
    ("causal dropout0.1", dict(causal=True, dropout_p=0.1)),
    ("varlen window (1024,1024) dropout0.1", dict(varlen=True, window_size=(1024, 1024),
                                                  dropout_p=0.1)),
    ("causal softcap30 dropout0.1", dict(causal=True, softcap=30.0, dropout_p=0.1)),
    ("varlen window (1024,1024) softcap30 alibi dropout0.1",
     dict(varlen=True, window_size=(1024, 1024), softcap=30.0, alibi_slopes=ALIBI,
          dropout_p=0.1)),
    ("determ causal dropout0.1", dict(deterministic=True, causal=True, dropout_p=0.1)),
    ("determ causal softcap30 dropout0.1", dict(deterministic=True, causal=True, softcap=30.0,
                                                dropout_p=0.1)),
    ("causal alibi dropout0.1", dict(causal=True, alibi_slopes=ALIBI, dropout_p=0.1)),
    ("determ varlen window (1024,1024) dropout0.1",
     dict(deterministic=True, varlen=True, window_size=(1024, 1024), dropout_p=0.1)),
]


def _problem(kw, d):
    """(call, flops) of one feature: ``call()`` runs the forward and returns (out, inputs)."""
    from solattn import flash_attn_func, flash_attn_varlen_func
    from solattn.bench.core import visible_pairs

    kw = dict(kw)
    gen = torch.Generator().manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    b, h, h_kv, s = 2, 8, 8, 4096
    if kw.pop("gqa", False):
        b, h, h_kv, s = 1, 16, 2, 2048
    causal = kw.get("causal", False)
    if kw.get("alibi_slopes") == ALIBI:
        kw["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, h + 1, device=dev) / h).float()
    if kw.pop("varlen", False):
        lens = torch.randint(256, 4097, (12,), generator=gen).tolist()
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        total = cu[-1].item()
        q, k, v = (torch.randn(total, h, d, device=dev, dtype=dt, requires_grad=True)
                   for _ in range(3))
        pairs = sum(visible_pairs(n, n, causal, kw.get("window_size")) for n in lens)

        def call():
            return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **kw), (q, k, v)
        return call, 2.5 * 4 * h * pairs * d
    q = torch.randn(b, s, h, d, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, s, h_kv, d, device=dev, dtype=dt, requires_grad=True)
            for _ in range(2))

    def call():
        return flash_attn_func(q, k, v, **kw), (q, k, v)
    return call, 2.5 * 4 * b * h * visible_pairs(s, s, causal, kw.get("window_size")) * d


def main() -> int:
    from solattn.bench.core import warm_up
    from solattn.dispatch import forced_backend

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="only the features whose label contains TEXT")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, d={args.head_dim}, backward TFLOP/s per round")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    warm_up(lambda: a @ a)  # (solattn bench's clock warm-up)
    ok = True
    for label, kw in FEATURES:
        if args.only not in label:
            continue
        call, flops = _problem(kw, args.head_dim)
        torch.manual_seed(0)  # (the dropout seed the forward draws)
        out, inputs = call()
        torch.manual_seed(1)
        dout = torch.randn_like(out)
        grads, timed = {}, {}
        for backend in ("hopper", "portable"):
            def grad(backend=backend):
                with forced_backend(backend):  # (the backward's route is taken at its call)
                    return torch.autograd.grad(out, inputs, dout, retain_graph=True)
            try:
                grads[backend] = grad()
            except NotImplementedError as exc:
                print(f"{label:40s} {backend}: not taken ({exc})", flush=True)
                continue
            timed[backend] = grad
        if len(grads) < 2:
            continue
        diff = max((x.float() - y.float()).abs().max().item()
                   for x, y in zip(grads["hopper"], grads["portable"]))
        ok &= diff <= 0.06
        rates = {name: [] for name in timed}
        for _ in range(args.rounds):
            for name, fn in timed.items():
                rates[name].append(flops / triton.testing.do_bench(fn, warmup=100, rep=400)
                                   / 1e9)
        cells = "  ".join(f"{n} {'/'.join(f'{r:.0f}' for r in rs)}" for n, rs in rates.items())
        print(f"{label:40s} {cells}  maxdiff {diff:.2g}", flush=True)
    print("gradients agree" if ok else "GRADIENTS DIFFER (above 0.06)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
