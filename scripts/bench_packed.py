"""The packed variants' cost: forward + backward of ``flash_attn_qkvpacked_func`` /
``flash_attn_kvpacked_func`` against ``flash_attn_func`` on separate q, k, v (GPU only).

    python3 scripts/bench_packed.py [--shapes 4,16,4096,128 ...] [--rounds 2]

The packed call's forward runs on views of the packed tensor (strided q, k, v); its backward
adds ``unbind``'s backward, one ``torch.stack`` of the gradients. Times are ``do_bench`` medians
(ms) of forward + ``torch.autograd.grad`` with a fixed output gradient, after a warm-up.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from solattn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


def step(fn, inputs, dout):
    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, inputs, dout)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4,16,4096,128", "1,32,4096,64"],
                    help="batch,heads,seqlen,headdim (kvpacked: GQA with heads / 8 kv heads)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dt = torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, causal, "
          "forward + backward ms (do_bench median)")
    for shape in a.shapes:
        b, h, s, d = (int(x) for x in shape.split(","))
        h_kv = max(1, h // 8)
        qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=dt, requires_grad=True)
        q3, k3, v3 = (t.detach().contiguous().requires_grad_() for t in qkv.unbind(2))
        q = torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=True)
        kv = torch.randn(b, s, 2, h_kv, d, device="cuda", dtype=dt, requires_grad=True)
        k2, v2 = (t.detach().contiguous().requires_grad_() for t in kv.unbind(2))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=dt)
        cases = {
            "MHA separate q, k, v": step(lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                                         (q3, k3, v3), dout),
            "MHA qkvpacked": step(lambda t: flash_attn_qkvpacked_func(t, causal=True), (qkv,),
                                  dout),
            f"GQA {h}/{h_kv} separate": step(
                lambda q, k, v: flash_attn_func(q, k, v, causal=True), (q, k2, v2), dout),
            f"GQA {h}/{h_kv} kvpacked": step(
                lambda q, t: flash_attn_kvpacked_func(q, t, causal=True), (q, kv), dout),
        }
        for fn in cases.values():  # compile and warm up
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for r in range(a.rounds):
            for name, fn in cases.items():
                ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
                print(f"B{b} H{h} L{s} D{d} round {r}: {name:<24} {ms:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
