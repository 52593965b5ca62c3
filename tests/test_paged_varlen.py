"""flash_attn_varlen_func over a paged KV cache (``block_table``) and with ``seqused_k``.

A serving engine's batch: a decode row (one query over a long context), a chunk of a chunked
prefill (queries at the end of earlier context), a fresh prefill, an empty sequence and one with
keys but no queries, in shuffled pages of a NaN-filled pool (a slot the kernel must not read
would turn the output to NaN). The oracle is :func:`solattn.reference.attention_varlen_ref` on
the keys gathered out of the pages by plain indexing; gradients reach the page pools.

CPU (interpreter): fp16, tiny shapes, 16-key tiles (pages of 16 and 48 hold whole tiles: one
page number per tile; pages of 5 take a page number per key row). GPU: bf16 + fp16, longer
sequences, and pages of 256 (one per tile of every table config) besides 16 / 48 / 5 (per row).
"""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, DTYPES, ON_GPU, assert_close, assert_lse_close, gpu_grid, randn
from test_backward import check_grads

from solattn import flash_attn_varlen_func
from solattn.core import make_params
from solattn.reference import attention_varlen_ref

# (queries, keys) per sequence: decode row, prefill chunk after 31 cached keys, empty
# sequence, fresh prefill, keys with no query, queries with no key.
MIXED = [(1, 37), (9, 40), (0, 0), (5, 5), (0, 20), (3, 0)]
if ON_GPU:
    MIXED = [(1, 1000), (130, 700), (0, 0), (257, 257), (0, 300), (3, 0)]
PAGE_SIZES = [16, *gpu_grid(48), 5] + ([256] if ON_GPU else [])  # CPU: 48 pages as 16 do
H, H_KV, D, DV = 4, 2, 32, 40

FEATURES = {
    "full": dict(),
    "causal": dict(causal=True),
    "local": dict(window_size=(6, 2)),
    "causal-local": dict(causal=True, window_size=(11, -1)),
    "causal-softcap-alibi": dict(causal=True, softcap=3.0, alibi=True),
}


def _cu(lens):
    return torch.tensor([0] + list(lens), device=DEVICE).cumsum(0).to(torch.int32)


def paged_cache(lens_k, page_size, h_kv, d, dv, dtype, *, spare_pages=3, shared_prefix=0):
    """A NaN-filled page pool holding each sequence's keys in shuffled pages.

    Returns ``(k_cache, v_cache, block_table, k, v)``: the pools ``(num_pages, page_size, h_kv,
    d[v])``, the ``(batch, max_pages)`` int32 table (entries past a sequence's pages are
    out-of-range padding, never read), and the packed contiguous keys ``(sum(lens_k), h_kv,
    d[v])`` for the oracle. ``shared_prefix`` pages of sequence 1 are those of sequence 0
    (prefix caching: both read, and get gradients through, the same pages)."""
    need = [-(-n // page_size) for n in lens_k]
    max_pages = max(need) + 1
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages).tolist()
    k_cache = torch.full((num_pages, page_size, h_kv, d), float("nan"), dtype=dtype,
                         device=DEVICE)
    v_cache = torch.full((num_pages, page_size, h_kv, dv), float("nan"), dtype=dtype,
                         device=DEVICE)
    table = torch.full((len(lens_k), max_pages), num_pages + 7, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lens_k):
        pages = [order.pop() for _ in range(need[b])]
        if b == 1 and shared_prefix:
            pages[:shared_prefix] = table[0, :shared_prefix].tolist()
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        kb, vb = randn(n, h_kv, d, dtype=dtype), randn(n, h_kv, dv, dtype=dtype)
        if b == 1 and shared_prefix:
            shared = shared_prefix * page_size
            kb[:shared], vb[:shared] = ks[0][:shared], vs[0][:shared]
        for i, page in enumerate(pages):
            rows = slice(i * page_size, min(n, (i + 1) * page_size))
            k_cache[page, : rows.stop - rows.start] = kb[rows]
            v_cache[page, : rows.stop - rows.start] = vb[rows]
        ks.append(kb)
        vs.append(vb)
    return k_cache, v_cache, table.to(DEVICE), torch.cat(ks), torch.cat(vs)


def gather_keys(k_cache, block_table, lens_k):
    """The oracle's view of a paged cache: each sequence's first ``lens_k[b]`` key rows, in
    order, packed (differentiable plain indexing)."""
    page_size = k_cache.shape[1]
    rows = []
    for b, n in enumerate(lens_k):
        pos = torch.arange(n, device=k_cache.device)
        rows.append(k_cache[block_table[b, pos // page_size].long(), pos % page_size])
    return torch.cat(rows)


def feature_kw(name, batch):
    kw = dict(FEATURES[name])
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(batch, H, device=DEVICE) * 0.3
    return kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_forward(page_size, feature, dtype):
    lens_q, lens_k = zip(*MIXED)
    kw = feature_kw(feature, len(MIXED))
    k_cache, v_cache, table, k, v = paged_cache(lens_k, page_size, H_KV, D, DV, dtype)
    q = randn(sum(lens_q), H, D, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q),
                                      max(lens_k), return_lse=True, block_table=table, **kw)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **kw)
    assert out.shape == (q.shape[0], H, DV) and lse.shape == (H, q.shape[0])
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


@pytest.mark.parametrize("h_kv", [1, 4], ids=["mqa", "mha"])
def test_paged_forward_heads_and_shared_pages(h_kv):
    """MQA / MHA, two sequences sharing their first pages (prefix caching), and sinks."""
    dtype = DTYPES[0]
    lens_q, lens_k = [4, 7], ([40, 45] if not ON_GPU else [400, 450])
    k_cache, v_cache, table, k, v = paged_cache(lens_k, 16, h_kv, D, D, dtype, shared_prefix=2)
    q = randn(sum(lens_q), H, D, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    sinks = torch.randn(H, device=DEVICE)
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q),
                                      max(lens_k), causal=True, return_lse=True,
                                      block_table=table, sinks=sinks)
    ref, ref_lse = _varlen_ref_sinks(q, k, v, cu_q, cu_k, sinks, causal=True)
    ref_lo, _ = _varlen_ref_sinks(q, k, v, cu_q, cu_k, sinks, causal=True, upcast=False)
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


def _varlen_ref_sinks(q, k, v, cu_q, cu_k, sinks, upcast=True, **kw):
    from solattn.reference import attention_ref

    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        o, lse = attention_ref(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None],
                               v[ck[b]:ck[b + 1]][None], sinks=sinks, upcast=upcast, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, -1)


@pytest.mark.parametrize("with_cu_seqlens_k", [True, False], ids=["cu_seqlens_k", "cu-none"])
def test_paged_seqused_k(with_cu_seqlens_k):
    """``seqused_k`` counts the keys (cu_seqlens_k may say more, or be None): the pages hold
    further, unused slots (NaN) that must not be read."""
    dtype = DTYPES[0]
    lens_q, lens_k = zip(*MIXED)
    cached = [n + 9 for n in lens_k]  # what cu_seqlens_k claims; only lens_k are used
    k_cache, v_cache, table, _, _ = paged_cache(cached, 16, H_KV, D, DV, dtype)
    k = gather_keys(k_cache, table, lens_k)
    v = gather_keys(v_cache, table, lens_k)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens_q), H, D, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, _cu(cached) if with_cu_seqlens_k else None, max(lens_q),
        max(cached), causal=True, return_lse=True, block_table=table, seqused_k=used)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    ref_lo, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


# seqused_k without a block table: head dim 128 on a GPU, where the default dispatch would
# otherwise pick the Hopper kernel (it declines seqused_k: its tail tiles read the NaN rows).
D_SEQUSED = 128 if ON_GPU else D


def _seqused_inputs(dtype):
    """Packed keys whose sequences end in unused (NaN) rows that seqused_k cuts off."""
    lens_q, used = [3, 1, 0, 6], [11, 30, 4, 0]
    if ON_GPU:
        lens_q, used = [130, 1, 0, 300], [500, 700, 40, 0]
    spans = [n + 5 for n in used]
    cu_q, cu_span = _cu(lens_q), _cu(spans)
    k = randn(sum(spans), H_KV, D_SEQUSED, dtype=dtype)
    v = randn(sum(spans), H_KV, D_SEQUSED, dtype=dtype)
    for b, n in enumerate(used):
        k[cu_span[b] + n: cu_span[b + 1]] = float("nan")
        v[cu_span[b] + n: cu_span[b + 1]] = float("nan")
    keep = torch.cat([torch.arange(int(cu_span[b]), int(cu_span[b]) + n)
                      for b, n in enumerate(used)]).to(DEVICE)
    q = randn(sum(lens_q), H, D_SEQUSED, dtype=dtype)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    return q, k, v, cu_q, cu_span, _cu(used), seqused, keep, max(lens_q), max(spans)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(4, 1))],
                         ids=["full", "causal", "local"])
def test_seqused_k_without_block_table(kw, dtype):
    q, k, v, cu_q, cu_span, cu_used, seqused, keep, max_q, max_k = _seqused_inputs(dtype)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_span, max_q, max_k, return_lse=True,
                                      seqused_k=seqused, **kw)
    ref, ref_lse = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, **kw)
    ref_lo, _ = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, upcast=False, **kw)
    assert_close("out", out, ref, ref_lo)
    assert_lse_close(lse, ref_lse.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(4, 1), softcap=3.0)],
                         ids=["causal", "local-softcap"])
def test_grad_seqused_k_without_block_table(kw, dtype):
    """Keys past seqused_k (NaN here) get zero gradients; the rest match the oracle's."""
    q, k, v, cu_q, cu_span, cu_used, seqused, keep, max_q, max_k = _seqused_inputs(dtype)
    # The oracle differentiates every row: unused ones hold 50 (a read would show), not NaN.
    k, v = torch.nan_to_num(k, nan=50.0), torch.nan_to_num(v, nan=50.0)

    def fn(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_span, max_q, max_k, seqused_k=seqused,
                                      **kw)

    def ref_fn(q, k, v, upcast):
        return attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, upcast=upcast, **kw)

    check_grads(fn, ref_fn, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
# Paged loads are the same code under every mask (each a constexpr of its own, tested unpaged):
# the interpreter runs both dQ strategies paged with the causal mask, the window with atomic dQ
# and softcap + ALiBi with the dQ kernel; the GPU suite runs the six.
@pytest.mark.parametrize("feature,deterministic", [
    ("causal", False), ("causal", True), ("local", False), ("causal-softcap-alibi", True),
    *[pytest.param(f, d, marks=pytest.mark.gpu_grid)
      for f, d in (("local", True), ("causal-softcap-alibi", False))],
])
@pytest.mark.parametrize("page_size", [*gpu_grid(16), 5])
def test_grad_paged(page_size, feature, deterministic, dtype):
    """dQ and the page pools' dK/dV (page-shaped; pages shared by two sequences sum)."""
    lens_q, lens_k = zip(*MIXED)
    lens_k = list(lens_k)
    lens_k[1] = max(lens_k[1], lens_k[0])  # sequence 1 extends sequence 0's shared pages
    kw = feature_kw(feature, len(MIXED))
    k_cache, v_cache, table, _, _ = paged_cache(lens_k, page_size, H_KV, D, D, dtype,
                                                shared_prefix=2)
    # The oracle differentiates every pool row: unused slots hold 50 (a read would show), not
    # NaN; their gradient is 0.
    k_cache, v_cache = torch.nan_to_num(k_cache, nan=50.0), torch.nan_to_num(v_cache, nan=50.0)
    q = randn(sum(lens_q), H, D, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def fn(q, kc, vc):
        return flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k),
                                      block_table=table, deterministic=deterministic, **kw)

    def ref_fn(q, kc, vc, upcast):
        k, v = gather_keys(kc, table, lens_k), gather_keys(vc, table, lens_k)
        return attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, **kw)

    _, dk, _ = check_grads(fn, ref_fn, q, k_cache, v_cache)
    assert dk.shape == k_cache.shape


def test_paged_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) carries block_table and seqused_k through the custom ops
    (forward and backward) with the eager values."""
    dtype = DTYPES[0]
    lens_q, lens_k = [1, 6, 0], [21, 30, 0]
    k_cache, v_cache, table, _, _ = paged_cache(lens_k, 16, H_KV, D, D, dtype)
    k_cache, v_cache = torch.nan_to_num(k_cache), torch.nan_to_num(v_cache)
    q = randn(sum(lens_q), H, D, dtype=dtype)
    cu_q = _cu(lens_q)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)

    def loss(q, kc, vc):
        out, lse = flash_attn_varlen_func(q, kc, vc, cu_q, None, max(lens_q), max(lens_k),
                                          causal=True, return_lse=True, block_table=table,
                                          seqused_k=used)
        return out.float().square().sum() + torch.nan_to_num(lse, neginf=0.0).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    results = []
    for f in (compiled, loss):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k_cache, v_cache)]
        value = f(*leaves)
        results.append((value, torch.autograd.grad(value, leaves)))
    (value_c, grads_c), (value_e, grads_e) = results
    torch.testing.assert_close(value_c, value_e, rtol=1e-3, atol=1e-3)
    for gc, ge in zip(grads_c, grads_e):
        assert torch.isfinite(gc).all()
        torch.testing.assert_close(gc, ge, rtol=2e-2, atol=2e-3)


def test_hopper_forward_falls_back_for_paged_and_seqused_calls():
    """The Hopper kernel declines paged and seqused_k calls with their reasons (the portable
    kernel runs them)."""
    from solattn.kernels.hopper import forward as hopper_forward

    q = torch.empty(2, 1, 128, dtype=torch.float16)
    pool = torch.empty(4, 16, 1, 128, dtype=torch.float16)
    cu = torch.zeros(2, dtype=torch.int32)
    p = make_params(q, pool, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=1,
                    block_table=torch.zeros(1, 1, dtype=torch.int32))
    covered, reason = hopper_forward.covers(q, pool, p)
    assert not covered and "block_table" in reason
    p = make_params(q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=1,
                    seqused_k=torch.zeros(1, dtype=torch.int32))
    covered, reason = hopper_forward.covers(q, q, p)
    assert not covered and "seqused_k" in reason


# ---------------------------------------------------------------------------------------------
# Validation: bad paged / seqused_k arguments raise before any launch
# ---------------------------------------------------------------------------------------------

def _paged_args():
    k_cache, v_cache, table, _, _ = paged_cache([20, 5], 16, H_KV, D, D, DTYPES[0])
    q = randn(3, H, D, dtype=DTYPES[0])
    return dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=_cu([2, 1]), cu_seqlens_k=_cu([20, 5]),
                max_seqlen_q=2, max_seqlen_k=20, block_table=table)


BAD_PAGED = {
    "table-dtype": (lambda a: dict(block_table=a["block_table"].long()), TypeError,
                    r"block_table: expected dtype torch.int32"),
    "table-batch": (lambda a: dict(block_table=a["block_table"][:1]), ValueError,
                    r"block_table: expected shape \(2, max_pages_per_seq\)"),
    "k-3d": (lambda a: dict(k=a["k"][0]), ValueError,
             r"k: expected a 4-D tensor of shape \(num_pages, page_size, nheads_kv, headdim\)"),
    "v-pages": (lambda a: dict(v=a["v"][:-1]), ValueError, r"v: expected num_pages"),
    "page-out-of-range": (lambda a: dict(block_table=a["block_table"].clone().fill_(99)),
                          ValueError, r"block_table: expected the pages of sequence 0"),
    "keys-beyond-table": (lambda a: dict(cu_seqlens_k=_cu([20, 100]), max_seqlen_k=100),
                          ValueError, r"cu_seqlens_k: expected key counts <= 48"),
    "seqused-dtype": (lambda a: dict(seqused_k=torch.ones(2, dtype=torch.int64, device=DEVICE)),
                      TypeError, r"seqused_k: expected dtype torch.int32"),
    "seqused-shape": (lambda a: dict(seqused_k=torch.ones(3, dtype=torch.int32, device=DEVICE)),
                      ValueError, r"seqused_k: expected shape \(2,\)"),
    "seqused-beyond-table": (
        lambda a: dict(seqused_k=torch.tensor([50, 1], dtype=torch.int32, device=DEVICE)),
        ValueError, r"seqused_k: expected key counts <= 48"),
    "cu-k-none-without-seqused": (lambda a: dict(cu_seqlens_k=None), ValueError,
                                  r"cu_seqlens_k: expected a \(batch \+ 1,\) int32 tensor"),
}


# Checks of tensor *values* run on CPU tensors only: on a GPU they would synchronize every call,
# and such inputs are undefined behaviour there, as in flash-attn (the kernel reads where the
# values point).
VALUE_CHECKS = {"page-out-of-range", "keys-beyond-table", "seqused-beyond-table"}


@pytest.mark.parametrize("case", list(BAD_PAGED))
def test_paged_bad_inputs(case):
    if ON_GPU and case in VALUE_CHECKS:
        pytest.skip("value checks run on CPU tensors only (undefined behaviour on a GPU)")
    args = _paged_args()
    change, exc, match = BAD_PAGED[case]
    args.update(change(args))
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(**args)


@pytest.mark.skipif(ON_GPU, reason="value checks run on CPU tensors only (undefined behaviour "
                                   "on a GPU)")
def test_seqused_k_beyond_its_sequence():
    """Without a block table, seqused_k[b] must fit sequence b's cu_seqlens_k span."""
    q, k, v = randn(3, H, D), randn(10, H_KV, D), randn(10, H_KV, D)
    with pytest.raises(ValueError, match=r"seqused_k: expected seqused_k\[b\] <= "):
        flash_attn_varlen_func(q, k, v, _cu([2, 1]), _cu([4, 6]), 2, 6,
                               seqused_k=torch.tensor([5, 1], dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
def test_paged_call_does_not_synchronize():
    """A paged forward + backward reads no device values on the host (CUDA sync debug mode
    turns any synchronizing op into an error)."""
    k_cache, v_cache, table, _, _ = paged_cache([300, 20], 16, H_KV, 64, 64, torch.bfloat16)
    k_cache, v_cache = torch.nan_to_num(k_cache), torch.nan_to_num(v_cache)
    q = randn(9, H, 64, dtype=torch.bfloat16)
    cu_q, cu_k = _cu([8, 1]), _cu([300, 20])
    used = torch.tensor([290, 20], dtype=torch.int32, device=DEVICE)
    q, k_cache, v_cache = (t.requires_grad_() for t in (q, k_cache, v_cache))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 8, 300, causal=True,
                                     block_table=table, seqused_k=used)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
