"""flash_attn_with_kvcache: append, rotary, paged caches of any page size, split-KV, masks.

Every case builds a *contiguous* reference cache, runs the oracle per sequence on exactly the keys
``[leftpad, cache_seqlens + seqlen_new)`` after a reference append, and compares out, lse and the
cache contents. Cache positions outside the live range hold NaN: a kernel that reads one leaks
NaN into the output, a kernel that writes one destroys the NaN (both are checked).
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import (
    DEVICE,
    DTYPES,
    GPU_GRID,
    ON_GPU,
    assert_close,
    assert_lse_close,
    gpu_grid,
    randn,
)

from solattn import flash_attn_with_kvcache
from solattn.configs import decode_num_splits, small_q_decode
from solattn.reference import attention_ref

NAN = float("nan")


# ----------------------------------------------------------------------------- reference helpers

def rope_ref(x, cos, sin, pos, interleaved):
    """Rotary on ``x (s, h, d)`` at positions ``pos (s,)``, float32 math, rounded to x's dtype."""
    rd = 2 * cos.shape[1]
    xf = x.float()
    c, s = cos[pos].float()[:, None, :], sin[pos].float()[:, None, :]
    xr = xf[..., :rd]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    return torch.cat([rot, xf[..., rd:]], -1).to(x.dtype)


def kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens, *, cos=None, sin=None, interleaved=True,
                batch_idx=None, leftpad=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None):
    """Reference append + attention on a contiguous cache (NaN padding allowed outside the live
    range). Returns ``(out_hi, lse_hi, out_lo, k_cache_after, v_cache_after)``."""
    kc, vc = k_cache.clone(), v_cache.clone()
    batch, s_q = q.shape[:2]
    s_new = k.shape[1] if k is not None else 0
    local = causal or window_size[0] >= 0 or window_size[1] >= 0
    outs_hi, lses, outs_lo = [], [], []
    for b in range(batch):
        row = batch_idx[b] if batch_idx is not None else b
        cs = cache_seqlens[b] if cache_seqlens is not None else k_cache.shape[1]
        qb = q[b]
        if k is not None:
            kn = k[b]
            if cos is not None:
                kn = rope_ref(kn, cos, sin, torch.arange(cs, cs + s_new), interleaved)
                pos = torch.arange(cs, cs + s_q) if local else torch.full((s_q,), cs)
                qb = rope_ref(qb, cos, sin, pos, interleaved)
            kc[row, cs:cs + s_new] = kn
            vc[row, cs:cs + s_new] = v[b]
        lp = leftpad[b] if leftpad is not None else 0
        keys, vals = kc[row, lp:cs + s_new][None], vc[row, lp:cs + s_new][None]
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        kw = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes)
        o_hi, l_hi = attention_ref(qb[None], keys, vals, **kw)
        o_lo, _ = attention_ref(qb[None], keys, vals, upcast=False, **kw)
        outs_hi.append(o_hi)
        lses.append(l_hi)
        outs_lo.append(o_lo)
    return torch.cat(outs_hi), torch.cat(lses).float(), torch.cat(outs_lo), kc, vc


def make_cache(batch_cache, capacity, h_kv, d, dtype, live):
    """Random cache with NaN everywhere outside ``live[row] = (start, end)``."""
    kc = randn(batch_cache, capacity, h_kv, d, dtype=dtype)
    for row in range(batch_cache):
        start, end = live.get(row, (0, 0))
        kc[row, :start] = NAN
        kc[row, end:] = NAN
    return kc


def to_paged(cache, page_size, spare_pages=3):
    """Scatter a contiguous cache ``(b, cap, h, d)`` into shuffled pages. Pages ``0 ..
    spare_pages - 1`` are NaN spares (page 0 is what a wrongly guarded page lookup returns).
    Returns ``(pages, block_table)``."""
    b, cap, h, d = cache.shape
    per_seq = cap // page_size
    n_pages = b * per_seq + spare_pages
    perm = spare_pages + torch.randperm(b * per_seq, device="cpu")
    pages = torch.full((n_pages, page_size, h, d), NAN, dtype=cache.dtype, device=cache.device)
    table = perm[: b * per_seq].view(b, per_seq).to(torch.int32)
    pages[table.flatten().long().to(cache.device)] = cache.reshape(b * per_seq, page_size, h, d)
    return pages, table.to(cache.device)


def from_paged(pages, table):
    b, per_seq = table.shape
    return pages[table.flatten().long()].reshape(b, per_seq * pages.shape[1], *pages.shape[2:])


def assert_cache_equal(name, got, ref, exact=True):
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{name}: NaN padding was overwritten"
    g, r = got.nan_to_num(0.0).float(), ref.nan_to_num(0.0).float()
    if exact:
        assert torch.equal(g, r), f"{name}: cache differs from the reference append"
    else:  # rotary: float32 math, possibly one rounding apart
        torch.testing.assert_close(g, r, atol=4e-3, rtol=2e-3, msg=f"{name}: rotated cache")


def lens_list(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t


def run_case(*, batch=2, s_q=1, h=4, h_kv=2, d=32, dv=None, capacity=64, cache_seqlens=(37, 20),
             s_new=0, page_size=None, rotary_dim=0, interleaved=True, causal=False,
             window_size=(-1, -1), softcap=0.0, alibi=False, leftpad=None, batch_idx=None,
             num_splits=0, dtype=torch.float16, seqlens_as_int=False):
    """Build inputs, run solattn and the reference, compare out/lse/cache; returns the outputs."""
    dv = dv or d
    lens = list(cache_seqlens)[:batch] if cache_seqlens is not None else None
    batch_cache = batch + 2 if batch_idx is not None else batch
    rows = batch_idx if batch_idx is not None else list(range(batch))
    live = {}
    for b in range(batch):
        start = leftpad[b] if leftpad is not None else 0
        # Positions the append will write start as NaN too: it must overwrite exactly them.
        end = lens[b] if lens is not None else capacity
        live[rows[b]] = (start, end)
    kc = make_cache(batch_cache, capacity, h_kv, d, dtype, live)
    vc = make_cache(batch_cache, capacity, h_kv, dv, dtype, live)
    q = randn(batch, s_q, h, d, dtype=dtype)
    k = randn(batch, s_new, h_kv, d, dtype=dtype) if s_new else None
    v = randn(batch, s_new, h_kv, dv, dtype=dtype) if s_new else None
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(capacity + 4, rotary_dim // 2, device=DEVICE) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slopes = torch.rand(batch, h, device=DEVICE) * 0.3 if alibi else None
    ref = kvcache_ref(q, kc, vc, k, v, lens, cos=cos, sin=sin, interleaved=interleaved,
                      batch_idx=batch_idx, leftpad=leftpad, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=slopes)
    out_hi, lse_hi, out_lo, kc_ref, vc_ref = ref

    def t32(x):
        return torch.tensor(x, dtype=torch.int32, device=DEVICE) if x is not None else None

    seqlens_arg = lens[0] if seqlens_as_int else t32(lens)
    kw = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens_arg,
              cache_batch_idx=t32(batch_idx), cache_leftpad=t32(leftpad), causal=causal,
              window_size=window_size, softcap=softcap, alibi_slopes=slopes,
              rotary_interleaved=interleaved, num_splits=num_splits, return_lse=True)
    if page_size is None:
        out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
        kc_after, vc_after = kc, vc
    else:
        kp, table = to_paged(kc, page_size)
        vp = kp.new_full((kp.shape[0], page_size, h_kv, dv), NAN)
        vp[table.flatten().long()] = vc.reshape(-1, page_size, h_kv, dv)
        out, lse = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
        kc_after, vc_after = from_paged(kp, table), from_paged(vp, table)
        spare = torch.ones(kp.shape[0], dtype=torch.bool, device=kp.device)
        spare[table.flatten().long()] = False
        assert torch.isnan(kp[spare]).all() and torch.isnan(vp[spare]).all(), \
            "spare pages were written"
    eps = 2e-4 if rotary_dim else 1e-5
    assert_close("out", out, out_hi, out_lo, eps=eps)
    assert_lse_close(lse, lse_hi, atol=2e-3)
    assert_cache_equal("k_cache", kc_after, kc_ref, exact=not rotary_dim)
    assert_cache_equal("v_cache", vc_after, vc_ref)
    return out, lse


# ----------------------------------------------------------------------------- CPU (interpreter)

@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("h,h_kv", [(4, 2), (3, 1), pytest.param(2, 2, marks=GPU_GRID)])
@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_varlen_gqa(s_q, h, h_kv, causal):
    run_case(s_q=s_q, h=h, h_kv=h_kv, causal=causal, cache_seqlens=(37, 5))


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_paged_page_sizes_match_contiguous(page_size):
    capacity = max(64, page_size)
    kw = dict(capacity=capacity, cache_seqlens=(41, 17), s_q=2, causal=True, num_splits=2)
    torch.manual_seed(0)
    out_c, lse_c = run_case(**kw)
    torch.manual_seed(0)
    out_p, lse_p = run_case(page_size=page_size, **kw)
    # Same inputs (same seed), same split boundaries: the paged result is the contiguous one.
    torch.testing.assert_close(out_p, out_c, atol=1e-3, rtol=0)
    torch.testing.assert_close(lse_p, lse_c, atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, *gpu_grid(16), 64])
@pytest.mark.parametrize("interleaved", [True, False])
def test_everything_together(page_size, interleaved):
    """paged + varlen cache_seqlens + GQA + append + rotary + window + speculative s_q."""
    run_case(batch=3, s_q=2, h=6, h_kv=2, capacity=128, cache_seqlens=(70, 3, 0), s_new=2,
             page_size=page_size, rotary_dim=16, interleaved=interleaved, causal=True,
             window_size=(24, 0), num_splits=3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_append_rotary_contiguous(causal, interleaved):
    # Non-causal: every query at position cache_seqlens (flash-attn's rule); rotary_dim < d.
    run_case(s_q=2, s_new=2, rotary_dim=16, d=32, interleaved=interleaved, causal=causal,
             cache_seqlens=(30, 9))


@pytest.mark.parametrize("page_size", [None, 16])
def test_append_without_rotary(page_size):
    run_case(s_q=3, s_new=3, cache_seqlens=(40, 0), causal=True, page_size=page_size)


def test_int_cache_seqlens():
    run_case(cache_seqlens=(25, 25), seqlens_as_int=True, s_new=1, s_q=1)


@pytest.mark.parametrize("num_splits", [1, 2, *gpu_grid(3, 5), 8])
def test_split_counts_agree(num_splits):
    kw = dict(capacity=128, cache_seqlens=(120, 77), s_q=2, causal=True)
    torch.manual_seed(1)
    out1, lse1 = run_case(num_splits=1, **kw)
    torch.manual_seed(1)
    out_n, lse_n = run_case(num_splits=num_splits, **kw)
    torch.testing.assert_close(out_n, out1, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse_n, lse1, atol=1e-4, rtol=0)


@pytest.mark.parametrize("window_size", [(8, 0), (5, 3), (-1, 2), (0, 0)])
def test_window(window_size):
    run_case(s_q=3, window_size=window_size, cache_seqlens=(50, 4), num_splits=2)


def test_softcap_alibi():
    run_case(s_q=2, softcap=5.0, alibi=True, causal=True, cache_seqlens=(45, 12), num_splits=3)


@pytest.mark.parametrize("page_size", [None, 16])
def test_leftpad(page_size):
    run_case(s_q=2, s_new=1, causal=True, leftpad=[5, 0], cache_seqlens=(40, 9),
             rotary_dim=16, page_size=page_size, alibi=True)


def test_cache_batch_idx():
    run_case(batch=2, batch_idx=[3, 0], s_new=2, s_q=2, rotary_dim=32, causal=True,
             cache_seqlens=(30, 11))


def test_full_cache_without_seqlens():
    run_case(cache_seqlens=None, capacity=48, s_q=2, causal=True)


def test_empty_sequence_rows():
    # A sequence with no keys at all: output 0, lse -inf (oracle semantics).
    out, lse = run_case(cache_seqlens=(0, 13), s_q=1)
    assert torch.isinf(lse[0]).all() and (out[0] == 0).all()


@pytest.mark.parametrize("page_size", [None, *gpu_grid(4), 32])
def test_chunked_prefill_many_queries(page_size):
    # s_q * group = 80 packed rows > one 64-row block: two m blocks per kv head, and the first
    # one's causal key range ends before seqlen_k (its masked tail tile reaches past the range).
    run_case(s_q=20, s_new=20, h=8, h_kv=2, causal=True, capacity=96, cache_seqlens=(50, 7),
             page_size=page_size, num_splits=2)


def test_headdim_v_differs():
    run_case(d=32, dv=16, s_q=1, cache_seqlens=(33, 18))


# ----------------------------------------------------------------------------- single launch

@pytest.fixture
def only_fused(monkeypatch):
    """Fail a call that runs any of the separate launches (append, attention, combine)."""
    import solattn.kernels.triton.decode as decode
    import solattn.kernels.triton.rotary as rotary

    def separate(*args, **kwargs):
        raise AssertionError("a separate launch ran for a call the fused launch covers")

    monkeypatch.setattr(rotary, "append_kv", separate)
    monkeypatch.setattr(decode, "attn_decode", separate)


def fused_semaphores():
    """Every arrival counter of every fused plan's workspaces (all 0 between launches)."""
    from solattn.kernels.triton.decode import _FUSED

    return [ws.semaphores for plan in _FUSED.values() for ws in plan._workspaces.values()
            if ws.semaphores is not None]


@pytest.mark.parametrize("page_size", [None, 1, 16])
# CPU: s_new=1 and 5 splits run the code s_new=3 and 3 splits run
@pytest.mark.parametrize("s_new", [0, *gpu_grid(1), 3])
@pytest.mark.parametrize("num_splits", [1, 3, *gpu_grid(5)])
def test_fused_single_launch(only_fused, page_size, s_new, num_splits):
    """Append, split-KV attention and the merge of the splits in one launch (GQA, varlen cache
    lengths, an empty sequence, speculative s_q = s_new)."""
    run_case(batch=3, s_q=max(s_new, 1), h=4, h_kv=2, capacity=256, cache_seqlens=(47, 0, 20),
             s_new=s_new, page_size=page_size, causal=True, num_splits=num_splits)
    assert all((c == 0).all() for c in fused_semaphores()), "arrival counters not reset"


@pytest.mark.parametrize("page_size", [None, 4])
def test_fused_new_tokens_straddle_splits(only_fused, page_size):
    # 35 keys in 16-key blocks over 3 splits of one block: new keys 30, 31 belong to split 1,
    # 32..34 to split 2; each split must write exactly its own before reading them.
    run_case(batch=2, s_q=5, h=2, h_kv=2, capacity=64, cache_seqlens=(30, 11), s_new=5,
             page_size=page_size, causal=True, num_splits=3)


@pytest.mark.parametrize("window_size", [(3, 0), (0, 0), (-1, -1)])
def test_fused_window_softcap_alibi_leftpad(only_fused, window_size):
    # A window narrower than the new tokens: some are appended but seen by no split's range.
    run_case(batch=2, s_q=4, s_new=4, h=4, h_kv=1, capacity=64, cache_seqlens=(40, 9),
             causal=window_size != (-1, -1), window_size=window_size, softcap=5.0, alibi=True,
             leftpad=[5, 0], num_splits=4)


@pytest.mark.parametrize("s_q", [1, 3])
def test_fused_merge_of_many_splits(only_fused, s_q):
    """More splits than one step of the fused merge takes (2048 // d = 16 at d=128), some of
    them past a short sequence's keys (weight 0), and packed rows over several 4-row merge
    steps (s_q * group = 12)."""
    run_case(batch=2, s_q=s_q, s_new=s_q, h=8, h_kv=2, d=128, capacity=640,
             cache_seqlens=(600, 90), causal=True, num_splits=37)


def test_fused_cache_batch_idx_dv(only_fused):
    run_case(batch=2, batch_idx=[3, 0], s_new=1, s_q=1, d=32, dv=16, causal=True,
             cache_seqlens=(30, 11), num_splits=2)


def test_fused_repeated_steps_reuse_workspace(only_fused):
    """Decode steps over one plan: the counters the last split resets serve the next launch."""
    for step in range(3):
        # capacity 256: 4 key blocks on the GPU too (block_n 64 there, 16 in the interpreter)
        run_case(batch=2, s_q=1, s_new=1, capacity=256, cache_seqlens=(40 + step, 7 + step),
                 causal=True, num_splits=4)
    assert fused_semaphores() and all((c == 0).all() for c in fused_semaphores())


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_separate_launches_path(page_size, num_splits):
    """The separate launches (the path of calls the fused one does not cover), forced."""
    from solattn.kvcache import separate_launches

    with separate_launches():
        run_case(s_q=2, s_new=2, capacity=64, cache_seqlens=(40, 3), causal=True,
                 page_size=page_size, num_splits=num_splits)


def test_fused_covers_reasons():
    from solattn.kernels.triton.decode import fused_covers

    q = torch.empty(1, 1, 8, 32)
    kc = torch.empty(1, 64, 2, 32)
    k = torch.empty(1, 1, 2, 32)
    assert fused_covers(q, kc, k, rotary=False) == ""
    assert fused_covers(q, kc, None, rotary=True) == ""  # nothing appended: nothing to rotate
    assert "rotary" in fused_covers(q, kc, k, rotary=True)
    wide = torch.empty(1, 20, 8, 32)  # 80 packed rows: two row blocks per kv head
    assert "several programs" in fused_covers(wide, kc, torch.empty(1, 20, 2, 32), rotary=False)
    assert fused_covers(wide, kc, None, rotary=False) == ""
    assert fused_covers(torch.empty(0, 1, 8, 32), kc, k, rotary=False) == "no query row"


def test_num_splits_heuristic():
    # Pure function: big batches need no split, a small batch over a long cache splits.
    assert decode_num_splits(512, 4096, 64, 132) == 1
    assert decode_num_splits(64, 32768, 64, 132) > 1
    assert decode_num_splits(1, 100, 64, 132) == 1
    assert decode_num_splits(1, 1 << 20, 64, 132) <= 128


@pytest.mark.parametrize("args,routed", [
    # (seqlen_q, seqlen_k, prefill CTAs = b * h * ceil(s_q / 128), SMs), H100 measurements
    ((1, 544, 32, 132), True),        # Hq32 Hkv4 d64: 1.16x
    ((1, 2048, 2048, 132), True),     # B64 Hq32: 2.25x
    ((8, 16, 4096, 132), True),       # up to 8 rows always
    ((16, 32768, 32, 132), True),     # B1 Hq32: 3.27x
    ((128, 32768, 32, 132), True),    # 1.98x
    ((16, 4096, 128, 132), False),    # B4 Hq32 Hkv8, short keys: 0.86x
    ((16, 32768, 128, 132), False),   # the grid fills more than half the SMs
    ((256, 32768, 64, 132), False),   # 1.12x: not worth a second kernel's numerics
    ((64, 4096, 32, 132), False),     # short keys
])
def test_small_q_rule(args, routed):
    """Which flash_attn_func calls run on the decode kernels (configs.small_q_decode)."""
    assert small_q_decode(*args) is routed


@pytest.mark.parametrize("s_q,h,h_kv,s_k,kw", [
    (1, 8, 2, 77, dict(causal=True)),
    (5, 4, 4, 300, dict(causal=True, window_size=(40, 0))),
    (3, 6, 2, 130, dict(softcap=2.0)),
    (2, 4, 1, 96, dict(causal=True, alibi=True)),
    (7, 4, 2, 5, dict(causal=True)),  # more queries than keys: the first rows see none
])
def test_decode_forward_matches_oracle(s_q, h, h_kv, s_k, kw):
    """The decode kernels as flash_attn_func's few-row forward (decode.decode_forward): the
    whole K/V as the cache, bottom-right aligned, output and LSE of the float64 oracle."""
    from solattn.core import make_params
    from solattn.kernels.triton.decode import decode_forward

    dtype = DTYPES[0]
    kw = dict(kw)
    alibi = torch.rand(h, device=DEVICE) * 0.3 if kw.pop("alibi", False) else None
    q = randn(2, s_q, h, 32, dtype=dtype)
    k, v = (randn(2, s_k, h_kv, 32, dtype=dtype) for _ in range(2))
    p = make_params(q, k, alibi_slopes=alibi, **kw)
    out, lse = decode_forward(q, k, v, p, True)
    hi, ref_lse = attention_ref(q, k, v, alibi_slopes=alibi, **kw)
    lo, _ = attention_ref(q, k, v, alibi_slopes=alibi, upcast=False, **kw)
    assert_close("out", out, hi, lo)
    assert_lse_close(lse, ref_lse)
    assert decode_forward(q, k, v, p, False)[1] is None


def test_compile_fullgraph_decode_step():
    """torch.compile(fullgraph=True) traces a decode step (append + rotary + paged attention)
    through the ``solattn::kvcache_fwd`` custom op: same output, same cache mutation as eager."""
    d, h, h_kv, page = 32, 4, 2, 16
    q, k, v = randn(2, 1, h, d), randn(2, 1, h_kv, d), randn(2, 1, h_kv, d)
    kc, table = to_paged(randn(2, 64, h_kv, d), page)
    vc, _ = to_paged(randn(2, 64, h_kv, d), page)
    angle = torch.rand(80, 8, device=DEVICE)
    cos, sin = angle.cos().half(), angle.sin().half()
    seqlens = torch.tensor([40, 7], dtype=torch.int32, device=DEVICE)

    def step(q, k, v, kc, vc):
        out = flash_attn_with_kvcache(q, kc, vc, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=seqlens, block_table=table, causal=True)
        return out.float() * 2.0

    kc_e, vc_e = kc.clone(), vc.clone()
    ref = step(q, k, v, kc_e, vc_e)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, v, kc, vc)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert torch.equal(kc.nan_to_num(0), kc_e.nan_to_num(0))
    assert torch.equal(vc.nan_to_num(0), vc_e.nan_to_num(0))


@pytest.mark.gpu
def test_compile_reduce_overhead_decode_steps():
    """torch.compile(mode="reduce-overhead") (CUDA graph trees: warm-up calls in the graphs'
    private memory pool, then replays) of an appending decode step over ~4k keys (the fused
    launch with several splits, merged through arrival counters in its workspace), beside a
    second compiled graph sharing the pool: bitwise the eager step's outputs and caches, step
    after step."""
    d, h, h_kv, cap = 128, 8, 2, 8192
    dt = torch.bfloat16
    kc, vc = randn(1, cap, h_kv, d, dtype=dt), randn(1, cap, h_kv, d, dtype=dt)
    kc_e, vc_e = kc.clone(), vc.clone()
    for t in (kc, vc):
        torch._dynamo.mark_static_address(t)
    lens = torch.full((1,), 4000, dtype=torch.int32, device=DEVICE)

    def step(q, k, v, kc, vc, lens):
        return flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    other = torch.compile(lambda x: torch.cumsum(x * 2.0, 0), mode="reduce-overhead")
    for _ in range(6):
        q = randn(1, 1, h, d, dtype=dt)
        k, v = randn(1, 1, h_kv, d, dtype=dt), randn(1, 1, h_kv, d, dtype=dt)
        ref = step(q, k, v, kc_e, vc_e, lens)
        got = compiled(q, k, v, kc, vc, lens).clone()
        other(randn(1 << 16, dtype=torch.float32))
        assert torch.equal(got, ref)
        lens += 1
    assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e)


# ----------------------------------------------------------------------------- bad inputs

def _inputs(batch=2, h=4, h_kv=2, d=32, cap=64):
    q = randn(batch, 1, h, d)
    kc = randn(batch, cap, h_kv, d)
    vc = randn(batch, cap, h_kv, d)
    return q, kc, vc


def t32(*vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("case,exc,msg", [
    ("q3d", ValueError, "q: expected a 4-D"),
    ("dtype", TypeError, "k_cache: expected dtype"),
    ("heads", ValueError, "nheads_kv"),
    ("k_without_v", ValueError, "k/v: expected both"),
    ("k_without_seqlens", ValueError, "cache_seqlens: expected an int"),
    ("seqlens_dtype", TypeError, "cache_seqlens: expected dtype torch.int32"),
    ("seqlens_shape", ValueError, "cache_seqlens: expected shape (2,)"),
    ("seqlens_overflow", ValueError, "cache_seqlens: expected values in"),
    ("page_not_pow2", ValueError, "power of two"),
    ("table_dtype", TypeError, "block_table: expected dtype torch.int32"),
    ("table_range", ValueError, "block_table: expected page numbers"),
    ("batch_idx_with_table", ValueError, "cache_batch_idx: expected None with block_table"),
    ("rotary_without_k", ValueError, "expected k and v"),
    ("rotary_half", ValueError, "rotary_cos/rotary_sin: expected both"),
    ("rotary_too_wide", ValueError, "rotary_dim"),
    ("num_splits", ValueError, "num_splits: expected an int >= 0"),
    ("window", ValueError, "window_size"),
    ("leftpad_gt_seqlen", ValueError, "cache_leftpad: expected 0 <="),
    ("batch_cache", ValueError, "batch_cache"),
])
def test_bad_inputs_raise(case, exc, msg):
    q, kc, vc = _inputs()
    kw = dict(cache_seqlens=t32(3, 4))
    k = randn(2, 1, 2, 32)
    cos = torch.ones(70, 8, dtype=torch.float16, device=DEVICE)
    if case == "q3d":
        q = q[0]
    elif case == "dtype":
        kc = kc.float()
    elif case == "heads":
        q = randn(2, 1, 3, 32)
    elif case == "k_without_v":
        kw["k"] = k
    elif case == "k_without_seqlens":
        kw.update(k=k, v=k, cache_seqlens=None)
    elif case == "seqlens_dtype":
        kw["cache_seqlens"] = torch.tensor([3, 4], device=DEVICE)
    elif case == "seqlens_shape":
        kw["cache_seqlens"] = t32(3)
    elif case == "seqlens_overflow":
        kw.update(k=k, v=k, cache_seqlens=t32(64, 1))
    elif case == "page_not_pow2":
        kc, vc = randn(8, 12, 2, 32), randn(8, 12, 2, 32)
        kw["block_table"] = t32(0, 1, 2, 3).view(2, 2)
    elif case == "table_dtype":
        kw["block_table"] = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    elif case == "table_range":
        kc, vc = randn(4, 16, 2, 32), randn(4, 16, 2, 32)
        kw["block_table"] = t32(0, 1, 2, 9).view(2, 2)
    elif case == "batch_idx_with_table":
        kc, vc = randn(4, 16, 2, 32), randn(4, 16, 2, 32)
        kw.update(block_table=t32(0, 1, 2, 3).view(2, 2), cache_batch_idx=t32(0, 1))
    elif case == "rotary_without_k":
        kw.update(rotary_cos=cos, rotary_sin=cos)
    elif case == "rotary_half":
        kw.update(k=k, v=k, rotary_cos=cos)
    elif case == "rotary_too_wide":
        wide = torch.ones(70, 24, dtype=torch.float16, device=DEVICE)
        kw.update(k=k, v=k, rotary_cos=wide, rotary_sin=wide)
    elif case == "num_splits":
        kw["num_splits"] = -1
    elif case == "window":
        kw["window_size"] = (-2, 0)
    elif case == "leftpad_gt_seqlen":
        kw["cache_leftpad"] = t32(4, 0)
    elif case == "batch_cache":
        kc, vc = kc[:1], vc[:1]
    if ON_GPU and case in ("seqlens_overflow", "table_range", "leftpad_gt_seqlen"):
        pytest.skip("value checks run only for CPU tensors (no device->host sync on a GPU)")
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        flash_attn_with_kvcache(q, kc, vc, **kw)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 1, 16, 256])
@pytest.mark.parametrize("s_q", [1, 4])
def test_gpu_decode_shapes(dtype, page_size, s_q):
    run_case(batch=4, s_q=s_q, h=32, h_kv=8, d=128, capacity=2048,
             cache_seqlens=(2048 - s_q, 1000, 17, 1537), s_new=s_q, page_size=page_size,
             rotary_dim=128, causal=True, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [0, 1, 7, 32])
def test_gpu_splits_long_cache(dtype, num_splits):
    run_case(batch=2, s_q=1, h=8, h_kv=1, d=64, capacity=8192, cache_seqlens=(8191, 3000),
             num_splits=num_splits, dtype=dtype, page_size=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96, 256])
def test_gpu_features(dtype, d):
    run_case(batch=3, s_q=5, h=12, h_kv=4, d=d, capacity=1024, cache_seqlens=(900, 300, 5),
             s_new=5, page_size=16, rotary_dim=min(d, 64), interleaved=False, causal=True,
             window_size=(200, 0), softcap=10.0, alibi=True, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("num_splits", [0, 7, 32])
def test_gpu_fused_decode(only_fused, dtype, page_size, num_splits):
    for step in range(2):  # the second step reuses the workspace the first one reset
        run_case(batch=2, s_q=1, h=32, h_kv=8, d=128, capacity=8192,
                 cache_seqlens=(4095 + step, 1000), s_new=1, page_size=page_size, causal=True,
                 num_splits=num_splits, dtype=dtype)
    torch.cuda.synchronize()
    assert all((c == 0).all() for c in fused_semaphores())


@pytest.mark.gpu
def test_gpu_fused_cuda_graph():
    """The fused launch captured in a CUDA graph: replays give the eager result (its
    workspace, made during capture, is the graph's own), and eager calls still do after."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    kc = randn(1, 4096, 8, 128, dtype=dt)
    vc = randn(1, 4096, 8, 128, dtype=dt)
    q, kn, vn = randn(1, 1, 32, 128, dtype=dt), randn(1, 1, 8, 128, dtype=dt), \
        randn(1, 1, 8, 128, dtype=dt)
    lens = torch.tensor([3000], dtype=torch.int32, device=DEVICE)

    def step():
        return flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, causal=True,
                                       return_lse=True)

    ref_out, ref_lse = (t.clone() for t in step())  # appending the same token is idempotent
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    out2, lse2 = step()
    assert torch.equal(out2, ref_out) and torch.equal(lse2, ref_lse)


@pytest.mark.gpu
def test_gpu_chunked_prefill():
    run_case(batch=2, s_q=300, s_new=300, h=16, h_kv=4, d=128, capacity=2048,
             cache_seqlens=(1500, 0), causal=True, page_size=16, dtype=torch.bfloat16)
