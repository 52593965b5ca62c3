"""Paged varlen forward (serving batches) against the same keys stored contiguously.

    python3 scripts/bench_paged_varlen.py

A batch as a serving engine schedules it (seeded): chunked-prefill chunks of 512 queries at the
end of 0-8k cached keys, plus decode rows (one query over 1k-8k keys); bf16, causal, GQA 32/8,
D128. The same keys are read from a shuffled page pool (``block_table``, pages of 16 and 256
tokens: one page number per key row / per key tile) and from a packed contiguous copy, on the
portable kernel (the one that runs paged calls) and on the default dispatch for the contiguous
copy. FLOPs = sum over sequences of 4 * H * D * (visible query-key pairs).
"""
import torch
import triton

from solattn import flash_attn_varlen_func
from solattn.dispatch import forced_backend

torch.manual_seed(0)
H, H_KV, D = 32, 8, 128
CHUNKS = [(512, int(n) + 512) for n in torch.randint(0, 8192, (6,))]
DECODES = [(1, int(n)) for n in torch.randint(1024, 8193, (32,))]


def visible_pairs(n_q, n_k):
    """Query-key pairs a bottom-right causal mask keeps."""
    return sum(min(n_k, n_k - n_q + i + 1) for i in range(n_q))


def main():
    seqs = CHUNKS + DECODES
    lens_q, lens_k = [s[0] for s in seqs], [s[1] for s in seqs]
    dev, dt = "cuda", torch.bfloat16
    cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), H, D, device=dev, dtype=dt)
    k = torch.randn(sum(lens_k), H_KV, D, device=dev, dtype=dt)
    v = torch.randn(sum(lens_k), H_KV, D, device=dev, dtype=dt)
    flops = sum(4 * H * D * visible_pairs(a, b) for a, b in seqs)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; {len(CHUNKS)} prefill chunks of 512 + {len(DECODES)} decode "
          f"rows, {sum(lens_k)} keys, H{H}/{H_KV} D{D} bf16 causal")
    args = (cu_q, cu_k, max(lens_q), max(lens_k))

    def bench(fn):
        out = fn()
        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"), out

    ref_ms, ref = bench(lambda: flash_attn_varlen_func(q, k, v, *args, causal=True))
    with forced_backend("portable"):
        port_ms, _ = bench(lambda: flash_attn_varlen_func(q, k, v, *args, causal=True))
    print(f"contiguous, default dispatch  {ref_ms:7.3f} ms  {flops / ref_ms * 1e-9:6.1f} TFLOP/s")
    print(f"contiguous, portable kernel   {port_ms:7.3f} ms  {flops / port_ms * 1e-9:6.1f} TFLOP/s")
    for page in (16, 256):
        need = [-(-n // page) for n in lens_k]
        pool_pages = sum(need)
        order = torch.randperm(pool_pages, device=dev)
        table = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=dev)
        k_pool = torch.empty(pool_pages, page, H_KV, D, device=dev, dtype=dt)
        v_pool = torch.empty_like(k_pool)
        start = 0
        for b, n in enumerate(lens_k):
            pages = order[start:start + need[b]]
            start += need[b]
            table[b, :need[b]] = pages.to(torch.int32)
            pos = torch.arange(n, device=dev)
            rows = slice(int(cu_k[b]), int(cu_k[b + 1]))
            k_pool[pages[pos // page], pos % page] = k[rows]
            v_pool[pages[pos // page], pos % page] = v[rows]
        ms, out = bench(lambda: flash_attn_varlen_func(q, k_pool, v_pool, *args, causal=True,
                                                       block_table=table))
        err = (out.float() - ref.float()).abs().max().item()
        print(f"paged, page {page:4d}            {ms:7.3f} ms  {flops / ms * 1e-9:6.1f} TFLOP/s  "
              f"paged/contiguous-portable {port_ms / ms:.2f}x  max|diff| {err:.1e}")


if __name__ == "__main__":
    main()
