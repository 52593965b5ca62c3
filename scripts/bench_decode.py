"""Decode benchmark: achieved KV-cache bandwidth of flash_attn_with_kvcache vs. peers, same run.

    python3 scripts/bench_decode.py [--sweep] [--quick] [--long] [--csv FILE]

GB/s = bytes of K and V read (the live cache, each byte once) / median time. Every function is
timed with ``triton.testing.do_bench_cudagraph`` (CUDA-graph replays: no launch gaps; the caches
are >= 1 GB, 20x the 50 MB L2, so repeated replays cannot be served from L2). Ceilings measured
in the same run: a device-to-device copy (``y.copy_(x)``, bytes read + written) and a pure read
(``x.sum()``... reported, not used as the denominator).

Peers: torch SDPA with the cuDNN and FLASH backends, ``q (b, h, s_q, d)`` against
``k/v (b, h_kv, L, d)`` with ``enable_gqa=True`` (no expanded copies); peers run non-causal for
``s_q > 1`` (SDPA's causal is top-left aligned, wrong for a cache), solattn runs causal (the
speculative-decoding mask), both read every key. flash-attn (FA2) is timed when importable.

``--sweep`` also times decode-kernel tile configs and split counts (the provenance of the tables
in ``solattn/configs.py``).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from solattn import flash_attn_with_kvcache
from solattn.configs import DecodeConfig, decode_config, decode_num_splits
from solattn.kernels.triton.decode import attn_decode
from solattn.params import AttnParams

try:
    from solattn.kvcache import separate_launches
except ImportError:  # an older tree without the fused decode launch
    separate_launches = None

SHAPES = [  # (batch, h_q, h_kv, cache length, head dim)
    (64, 32, 8, 4096, 128),
    (8, 32, 8, 32768, 128),
]


def bench(fn) -> float:
    """Median milliseconds of CUDA-graph replays of ``fn`` (plain launches if it cannot be
    captured; then the L2 is flushed between runs by do_bench)."""
    fn()
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception as exc:  # e.g. a peer that cannot be captured
        print(f"# (no CUDA graph for this function: {type(exc).__name__}; plain do_bench)")
        torch.cuda.synchronize()
        return do_bench(fn, warmup=20, rep=60, return_mode="median")


def ceilings():
    n = 1 << 30  # 1 GiB of bf16
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    copy = 2 * n / ms / 1e6
    ms = bench(lambda: x.sum(dtype=torch.float32))
    read = n / ms / 1e6
    return copy, read


def paged_copy(kc: torch.Tensor, vc: torch.Tensor, page: int):
    """Scatter caches ``(b, L, h, d)`` into randomly ordered pages (the same order for K and V,
    as a serving engine allocates them); returns ``(k_pages, v_pages, block_table)``."""
    b, L, h, d = kc.shape
    n = b * L // page
    perm = torch.randperm(n, device=kc.device)
    pages = []
    for cache in (kc, vc):
        p = torch.empty(n, page, h, cache.shape[-1], dtype=cache.dtype, device=cache.device)
        p[perm] = cache.reshape(n, page, h, cache.shape[-1])
        pages.append(p)
    return pages[0], pages[1], perm.view(b, L // page).to(torch.int32)


def peers(q, kc, vc, s_q):
    """SDPA (cuDNN, FLASH) and flash-attn callables on the same data, or notes why not."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    qt = q.transpose(1, 2).contiguous()            # (b, h, s_q, d)
    kt = kc.transpose(1, 2).contiguous()           # (b, h_kv, L, d)
    vt = vc.transpose(1, 2).contiguous()
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            fn()
            out[name] = fn
        except Exception as exc:  # the backend refuses this shape: say so in the table
            out[name] = f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"
    try:
        from flash_attn import flash_attn_with_kvcache as fa2
        out["flash-attn"] = lambda: fa2(q, kc, vc, causal=s_q > 1)
    except ImportError:
        out["flash-attn"] = "n/a (flash_attn not installed on the device)"
    return out, (kt, vt)


def run_table(args, copy_bw):
    rows = []
    for (b, h, h_kv, L, d) in SHAPES:
        kv_bytes = 2 * b * L * h_kv * d * 2
        kc = torch.randn(b, L, h_kv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        layouts = {"contig": (kc, vc, None)}
        for page in (16, 256):
            kp, vp, table = paged_copy(kc, vc, page)
            layouts[f"paged{page}"] = (kp, vp, table)
        t_decode = {}
        for s_q in (1, 4, 8) if not args.quick else (1,):
            q = torch.randn(b, s_q, h, d, device="cuda", dtype=torch.bfloat16)
            ref = None
            for lname, (kk, vv, table) in layouts.items():
                fn = lambda kk=kk, vv=vv, table=table: flash_attn_with_kvcache(
                    q, kk, vv, cache_seqlens=seqlens, block_table=table, causal=s_q > 1)
                o = fn()
                if ref is None:
                    ref = o
                diff = (o.float() - ref.float()).abs().max().item()
                ms = bench(fn)
                if s_q == 1:
                    t_decode[lname] = ms
                gbs = kv_bytes / ms / 1e6
                rows.append((f"B{b} Hq{h} Hkv{h_kv} L{L} d{d}", s_q, f"solattn {lname}", ms, gbs,
                             gbs / copy_bw, ms / t_decode[lname], f"max|o-o_contig|={diff:.1e}"))
            pe, keep = peers(q, kc, vc, s_q)
            for name, fn in pe.items():
                if isinstance(fn, str):
                    rows.append((f"B{b} Hq{h} Hkv{h_kv} L{L} d{d}", s_q, name, math.nan,
                                 math.nan, math.nan, math.nan, fn))
                    continue
                ms = bench(fn)
                gbs = kv_bytes / ms / 1e6
                rows.append((f"B{b} Hq{h} Hkv{h_kv} L{L} d{d}", s_q, name, ms, gbs,
                             gbs / copy_bw, math.nan, ""))
            del keep
        del layouts, kc, vc
        torch.cuda.empty_cache()
    return rows


def run_sweep(copy_bw, configs=None):
    """Tile configs at the heuristic split count, then split counts at the default config
    (``configs``: only these ``(block_n, warps, stages)``, contiguous, no split sweep)."""
    print("\n# sweep: decode kernel configs (s_q=1, contiguous and paged16, bf16)")
    print(f"{'shape':<28} {'layout':<8} {'bn':>4} {'w':>2} {'st':>3} {'splits':>6} "
          f"{'ms':>8} {'GB/s':>7} {'%copy':>6}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (b, h, h_kv, L, d) in SHAPES:
        kv_bytes = 2 * b * L * h_kv * d * 2
        kc = torch.randn(b, L, h_kv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        kp, vp, table = paged_copy(kc, vc, 16)
        seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        base = decode_config(90, d, d, h // h_kv)
        heur = decode_num_splits(b * h_kv, L, base.block_n, sms)
        cands = [(bn, w, st) for bn in (32, 64, 128) for w in (4,) for st in (2, 3, 4)
                 if st * bn * d * 4 <= 160 * 1024] + [(64, 8, 3), (128, 8, 3)]
        if configs:
            trials = [(c, heur, "contig") for c in configs]
        else:
            trials = [(c, heur, "contig") for c in cands]
            trials += [((base.block_n, base.num_warps, base.num_stages), s, "contig")
                       for s in (1, 2, 3, 4, 6, 8, 12, 16, 32) if s != heur]
            trials += [(c, heur, "paged16") for c in cands]
        for (bn, w, st), splits, layout in trials:
            cfg = DecodeConfig(block_m=base.block_m, block_n=bn, num_warps=w, num_stages=st)
            kk, vv, tb = (kc, vc, None) if layout == "contig" else (kp, vp, table)
            fn = lambda: attn_decode(
                q, kk, vv, AttnParams(scale=d ** -0.5, group_size=h // h_kv),
                cache_seqlens=seqlens, seqlen_new=0,
                cache_batch_idx=None, cache_leftpad=None, block_table=tb, num_splits=splits,
                arch=90, num_sms=sms, config=cfg)
            try:
                ms = bench(fn)
            except Exception as exc:  # e.g. out of shared memory: report and go on
                print(f"B{b} L{L} {layout} bn{bn} w{w} st{st} s{splits}: {type(exc).__name__}")
                continue
            gbs = kv_bytes / ms / 1e6
            print(f"{f'B{b} Hq{h} Hkv{h_kv} L{L}':<28} {layout:<8} {bn:>4} {w:>2} {st:>3} "
                  f"{splits:>6} {ms:>8.4f} {gbs:>7.0f} {100 * gbs / copy_bw:>5.1f}%", flush=True)
        del kc, vc, kp, vp
        torch.cuda.empty_cache()


LONG = [(1, 32, 8, L, 128) for L in (32768, 65536, 131072, 262144)]


def long_inputs(b, h, h_kv, L, d):
    """``(K+V bytes, k cache, v cache, cache_seqlens, q)`` of a full cache of ``L`` keys, one
    query token, bf16."""
    kc = torch.randn(b, L, h_kv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    return 2 * b * L * h_kv * d * 2, kc, vc, seqlens, q


def run_long(read_bw, split_counts=(8, 16, 24, 32, 48, 64, 96, 128)):
    """Batch-1 long-context decode: split counts in GPU time (CUDA graph), the public call with
    the default split count in GPU time and eager (host included), the same through the separate
    launches (append, split-KV, combine: ``separate_launches``), and cuDNN, against the read
    ceiling ``read_bw`` (K and V bytes / time)."""
    print("\n# long-context decode, s_q=1, bf16; GB/s = K+V bytes / time; % of the read ceiling")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (b, h, h_kv, L, d) in LONG:
        kv_bytes, kc, vc, seqlens, q = long_inputs(b, h, h_kv, L, d)
        base = decode_config(90, d, d, h // h_kv)
        heur = decode_num_splits(b * h_kv, L, base.block_n, sms)
        shape = f"B{b} Hq{h} Hkv{h_kv} L{L}"

        def line(what, ms):
            gbs = kv_bytes / ms / 1e6
            print(f"{shape:<24} {what:<26} {ms * 1e3:>9.1f} us {gbs:>7.0f} GB/s "
                  f"{100 * gbs / read_bw:>5.1f}%", flush=True)

        for splits in sorted({heur, *split_counts}):
            fn = lambda splits=splits: flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=seqlens, num_splits=splits)
            line(f"splits={splits}" + (" (default)" if splits == heur else ""), bench(fn))
        fn = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        line("default, eager", do_bench(fn, warmup=20, rep=100, return_mode="median"))
        if separate_launches is not None:
            with separate_launches():
                line("default, separate launches", bench(fn))
                line("default, eager, separate", do_bench(fn, warmup=20, rep=100,
                                                          return_mode="median"))
        pe, _keep = peers(q, kc, vc, 1)
        for name, pfn in pe.items():
            if not isinstance(pfn, str):
                line(name, bench(pfn))
        kc = vc = _keep = None  # free the caches before the next length
        torch.cuda.empty_cache()


def run_long_sweep(read_bw, configs, split_counts):
    """Batch-1 long-context decode through the single launch (:func:`fused_decode`, no append):
    each ``(block_n, warps, stages)`` config at each split count, GPU time (CUDA graph)."""
    from solattn.kernels.triton.decode import fused_decode

    print("\n# long-context decode sweep, fused launch, s_q=1, bf16; % of the read ceiling")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (b, h, h_kv, L, d) in LONG:
        kv_bytes, kc, vc, seqlens, q = long_inputs(b, h, h_kv, L, d)
        p = AttnParams(scale=d ** -0.5, group_size=h // h_kv)
        base = decode_config(90, d, d, h // h_kv)
        for bn, w, st in configs:
            cfg = DecodeConfig(block_m=base.block_m, block_n=bn, num_warps=w, num_stages=st)
            for splits in split_counts:
                fn = lambda cfg=cfg, splits=splits: fused_decode(
                    q, kc, vc, None, None, p, cache_seqlens=seqlens, cache_batch_idx=None,
                    cache_leftpad=None, block_table=None, num_splits=splits, arch=90,
                    num_sms=sms, config=cfg)
                try:
                    ms = bench(fn)
                except Exception as exc:  # e.g. out of shared memory: report and go on
                    print(f"L{L} bn{bn} w{w} st{st} s{splits}: {type(exc).__name__}")
                    continue
                gbs = kv_bytes / ms / 1e6
                print(f"L{L:<7} bn{bn:<4} w{w} st{st} splits {splits:<4} {ms * 1e3:>8.1f} us "
                      f"{gbs:>6.0f} GB/s {100 * gbs / read_bw:>5.1f}%", flush=True)
        kc = vc = None
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also sweep decode configs / splits")
    p.add_argument("--configs", default=None,
                   help="with --sweep: only these configs, e.g. '32,4,3 64,4,3' (bn,warps,stages)")
    p.add_argument("--quick", action="store_true", help="seqlen_q = 1 only")
    p.add_argument("--long", action="store_true",
                   help="only batch-1 decode at Lk 32k-256k: split counts, eager, cuDNN")
    p.add_argument("--long-splits", default="8,16,24,32,48,64,96,128",
                   help="with --long: the split counts timed besides the default")
    p.add_argument("--long-sweep", default=None,
                   help="only the fused batch-1 long decode: these configs at --long-splits, "
                        "e.g. '32,4,3 64,4,4' (bn,warps,stages)")
    p.add_argument("--csv", default=None, help="write the table as CSV here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name(0)
    copy_bw, read_bw = ceilings()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}, bf16")
    print(f"# ceilings: device-to-device copy {copy_bw:.0f} GB/s (read+write), "
          f"x.sum() read {read_bw:.0f} GB/s")
    if args.long_sweep:
        run_long_sweep(read_bw, [tuple(int(x) for x in c.split(",")) for c in
                                 args.long_sweep.split()],
                       [int(x) for x in args.long_splits.split(",") if x])
        return 0
    if args.long:
        run_long(read_bw, [int(x) for x in args.long_splits.split(",") if x])
        return 0
    if args.sweep:
        configs = None
        if args.configs:
            configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split()]
        run_sweep(copy_bw, configs)
    rows = run_table(args, copy_bw)
    print("\n# decode: GB/s = K+V bytes read / median time (CUDA graph); %copy = / copy ceiling,"
          " %read = / x.sum() read ceiling")
    hdr = (f"{'shape':<28} {'s_q':>3} {'impl':<18} {'ms':>8} {'GB/s':>7} {'%copy':>6} "
           f"{'%read':>6} {'t/t(s_q=1)':>10}  note")
    print(hdr)
    for shape, s_q, impl, ms, gbs, frac, rel, note in rows:
        print(f"{shape:<28} {s_q:>3} {impl:<18} {ms:>8.4f} {gbs:>7.0f} {100 * frac:>5.1f}% "
              f"{100 * gbs / read_bw:>5.1f}% {rel:>10.3f}  {note}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("shape,s_q,impl,ms,GBps,frac_of_copy,time_vs_sq1,note\n")
            for r in rows:
                f.write(",".join(str(x) for x in r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
