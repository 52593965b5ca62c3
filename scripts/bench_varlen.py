"""Varlen forward TFLOP/s: the Hopper kernel against the portable one on the same packed batch.

    python3 scripts/bench_varlen.py

A packed batch of sequences of mixed lengths (seeded), bf16, H16 (GQA 16/4 too), D128 and D64,
full and causal. FLOPs = sum over sequences of 4 * H * Lq * Lk * D (halved for causal).
SDPA has no packed-sequence entry point, so there is no cuDNN / FA2 column here.
"""
import torch
import triton

from solattn.core import attn_forward, make_params

torch.manual_seed(0)
LENS = [int(x) for x in torch.randint(256, 4097, (12,))]


def main():
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    total, longest = sum(LENS), max(LENS)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; {len(LENS)} sequences, {total} tokens, lengths {LENS}")
    for h, h_kv, d in [(16, 16, 128), (16, 4, 128), (32, 32, 64)]:
        q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, h_kv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(total, h_kv, d, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            flops = sum(4 * h * n * n * d for n in LENS) / (2 if causal else 1)
            res = {}
            for backend in ("hopper", "portable"):
                p = make_params(q, k, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=longest, max_seqlen_k=longest)

                def fn(p=p, backend=backend):
                    return attn_forward(q, k, v, p, backend=backend)
                out = fn()[0]
                res[backend] = (triton.testing.do_bench(fn, warmup=50, rep=200,
                                                        return_mode="median"), out)
            err = (res["hopper"][1].float() - res["portable"][1].float()).abs().max().item()
            line = "  ".join(f"{b} {flops / ms * 1e-9:6.1f}" for b, (ms, _) in res.items())
            print(f"H{h}/{h_kv} D{d} {'causal' if causal else 'full  '}  TFLOP/s: {line}  "
                  f"hopper/portable {res['portable'][0] / res['hopper'][0]:.2f}x  "
                  f"max|diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
