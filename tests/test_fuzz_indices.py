"""Fuzz of the index tensors (issue 39): whatever values ``cu_seqlens_q/k``, ``seqused_k``,
``block_table``, ``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad`` or a BlockMask's
counts and indices hold, a call either raises a clear error naming the argument or returns --
the kernels clamp every index they read into the tensors' extents, so nothing is read or
written outside them -- and a valid call afterwards still matches the oracle (the process is
usable: no poisoned CUDA context).

On the CPU (Triton's interpreter) solattn checks index values on the host before any launch;
the fixture ``unchecked`` turns those checks off (``validation.values_unreadable``, as on a GPU
by default) so that the invalid values reach the kernels here too. A few seeds per entry point
run on the CPU; the ``gpu`` cases run many more (``tools/gpu_robustness.sh`` runs a sample of
them under compute-sanitizer's memcheck as well). flash_attn_func (batched) takes no index
tensor: its entry point is covered through the decode kernels it shares with kvcache.
"""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, ON_GPU, ON_SM90, assert_close

from solattn import flash_attn_varlen_func, flash_attn_with_kvcache
from solattn import validation as V
from solattn.reference import attention_ref, attention_varlen_ref

CPU_SEEDS = [0, 1]
GPU_SEEDS = list(range(2, 22))
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# What a rejected call may raise: the argument's name must be in the message, and a CUDA error
# (an illegal address, a device-side assert) never counts.
CLEAR_ERRORS = (ValueError, TypeError, RuntimeError, NotImplementedError)
D, H, H_KV = 16, 2, 1
DT = torch.float16


def seeds(cpu=CPU_SEEDS):
    """``cpu`` seeds everywhere, GPU seeds marked ``gpu`` (skipped without one)."""
    return cpu + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SEEDS]


@pytest.fixture
def unchecked(monkeypatch):
    """No host-side value checks (the GPU default, also on the CPU)."""
    monkeypatch.setattr(V, "values_unreadable", lambda t: True)


def bad_values(like: torch.Tensor, extent: int, gen: torch.Generator) -> torch.Tensor:
    """Invalid int32 values shaped like ``like``: huge, negative, mixed around ``extent``, or
    a decreasing run, by the generator's draw."""
    shape, mode = like.shape, int(torch.randint(0, 4, (1,), generator=gen))
    if mode == 0:
        vals = torch.randint(extent + 1, INT32_MAX, shape, generator=gen)
    elif mode == 1:
        vals = torch.randint(INT32_MIN, 0, shape, generator=gen)
    elif mode == 2:
        vals = torch.randint(-3 * extent - 3, 3 * extent + 3, shape, generator=gen)
    else:
        vals = torch.arange(like.numel(), 0, -1).reshape(shape) * (extent + 1)
    return vals.to(torch.int32).to(like.device)


def call_or_clear_error(fn, names):
    """``fn()``'s result, or None if it raised a clear error naming one of ``names``."""
    try:
        out = fn()
        if ON_GPU:
            torch.cuda.synchronize()  # an illegal address surfaces here
        return out
    except CLEAR_ERRORS as exc:
        msg = str(exc)
        assert "CUDA error" not in msg and "illegal" not in msg, msg
        assert any(n in msg for n in names), f"error names none of {names}: {msg}"
        return None


def rand(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=DT, device=DEVICE, requires_grad=requires_grad)


def i32(vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# varlen (forward and backward)
# ---------------------------------------------------------------------------------------------

LENS_Q, LENS_K = [5, 0, 7], [6, 3, 9]


def _cu(lens):
    return i32([0, *torch.tensor(lens).cumsum(0).tolist()])


@pytest.mark.parametrize("target", ["cu_seqlens_q", "cu_seqlens_k", "seqused_k"])
@pytest.mark.parametrize("seed", seeds())
def test_varlen(target, seed, unchecked):
    gen = torch.Generator().manual_seed(seed)
    q = rand(sum(LENS_Q), H, D, requires_grad=True)
    k, v = (rand(sum(LENS_K), H_KV, D, requires_grad=True) for _ in range(2))
    args = dict(cu_seqlens_q=_cu(LENS_Q), cu_seqlens_k=_cu(LENS_K), seqused_k=i32(LENS_K))
    args[target] = bad_values(args[target], sum(LENS_K), gen)

    def run():
        out = flash_attn_varlen_func(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"],
                                     max(LENS_Q), max(LENS_K), seqused_k=args["seqused_k"],
                                     causal=True)
        out.float().sum().backward()
        return out

    out = call_or_clear_error(run, [target])
    assert out is None or out.shape == q.shape
    # a valid call afterwards matches the oracle
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True)
    hi = attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)[0]
    lo = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)[0]
    assert_close("out", out, hi, lo)


# ---------------------------------------------------------------------------------------------
# paged varlen
# ---------------------------------------------------------------------------------------------

PAGE, PAGES, MAX_PAGES = 4, 8, 3


def _paged_pool():
    k_pool, v_pool = rand(PAGES, PAGE, H_KV, D), rand(PAGES, PAGE, H_KV, D)
    table = i32([[0, 1, 2], [3, 4, 5], [6, 7, 1]])
    return k_pool, v_pool, table


def _gather(pool, table, lens):
    """The contiguous keys of each sequence, packed (for the oracle)."""
    rows = [pool[table[b, j // PAGE], j % PAGE] for b, n in enumerate(lens) for j in range(n)]
    return torch.stack(rows)


@pytest.mark.parametrize("target", ["block_table", "seqused_k", "cu_seqlens_k"])
@pytest.mark.parametrize("seed", seeds())
def test_paged_varlen(target, seed, unchecked):
    gen = torch.Generator().manual_seed(seed)
    q = rand(sum(LENS_Q), H, D)
    k_pool, v_pool, table = _paged_pool()
    args = dict(block_table=table, seqused_k=i32(LENS_K), cu_seqlens_k=_cu(LENS_K))
    extent = PAGES if target == "block_table" else MAX_PAGES * PAGE
    args[target] = bad_values(args[target], extent, gen)
    used = None if target == "cu_seqlens_k" else args["seqused_k"]

    def run():
        return flash_attn_varlen_func(q, k_pool, v_pool, _cu(LENS_Q), args["cu_seqlens_k"],
                                      max(LENS_Q), MAX_PAGES * PAGE, seqused_k=used,
                                      block_table=args["block_table"], causal=True)

    out = call_or_clear_error(run, [target])
    assert out is None or out.shape == q.shape
    out = flash_attn_varlen_func(q, k_pool, v_pool, _cu(LENS_Q), _cu(LENS_K), max(LENS_Q),
                                 max(LENS_K), block_table=table, causal=True)
    k, v = _gather(k_pool, table, LENS_K), _gather(v_pool, table, LENS_K)
    hi = attention_varlen_ref(q.double(), k.double(), v.double(), _cu(LENS_Q), _cu(LENS_K),
                              causal=True)[0]
    lo = attention_varlen_ref(q, k, v, _cu(LENS_Q), _cu(LENS_K), causal=True, upcast=False)[0]
    assert_close("out", out, hi, lo)


# ---------------------------------------------------------------------------------------------
# kvcache: contiguous (with cache_batch_idx, cache_leftpad), paged, rotary (separate launches)
# ---------------------------------------------------------------------------------------------

B, S_CACHE, S_NEW = 3, 16, 2
SEQLENS, BATCH_IDX, LEFTPAD = [5, 0, 9], [2, 0, 3], [1, 0, 2]


def _kvcache_oracle(q, k_cache, v_cache, k_new, v_new, rows, seqlens, leftpad):
    """Per sequence: its cache rows [leftpad, seqlen) then the new keys, causal."""
    outs_hi, outs_lo = [], []
    for b in range(q.shape[0]):
        kb = torch.cat([k_cache[rows[b], leftpad[b]:seqlens[b]], k_new[b]])[None]
        vb = torch.cat([v_cache[rows[b], leftpad[b]:seqlens[b]], v_new[b]])[None]
        outs_hi.append(attention_ref(q[b:b + 1].double(), kb.double(), vb.double(),
                                     causal=True)[0])
        outs_lo.append(attention_ref(q[b:b + 1], kb, vb, causal=True, upcast=False)[0])
    return torch.cat(outs_hi), torch.cat(outs_lo)


@pytest.mark.parametrize("rotary", [False, True], ids=["fused", "rotary"])
@pytest.mark.parametrize("target", ["cache_seqlens", "cache_batch_idx", "cache_leftpad"])
@pytest.mark.parametrize("seed", seeds())
def test_kvcache(target, seed, rotary, unchecked):
    if rotary and target == "cache_leftpad":
        pytest.skip("covered by the fused variant (leftpad reaches the same decode kernel)")
    gen = torch.Generator().manual_seed(seed)
    q = rand(B, 1, H, D)
    k_cache, v_cache = rand(4, S_CACHE, H_KV, D), rand(4, S_CACHE, H_KV, D)
    k_new, v_new = rand(B, S_NEW, H_KV, D), rand(B, S_NEW, H_KV, D)
    args = dict(cache_seqlens=i32(SEQLENS), cache_batch_idx=i32(BATCH_IDX),
                cache_leftpad=i32(LEFTPAD))
    args[target] = bad_values(args[target], 4 if target == "cache_batch_idx" else S_CACHE, gen)
    rope = {}
    if rotary:
        angle = torch.rand(S_CACHE, D // 4, device=DEVICE)
        rope = dict(rotary_cos=angle.cos().to(DT), rotary_sin=angle.sin().to(DT))
        args.pop("cache_leftpad")

    def run():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, causal=True, **rope,
                                       **args)

    out = call_or_clear_error(run, [target])
    assert out is None or out.shape == q.shape
    k_cache, v_cache = rand(4, S_CACHE, H_KV, D), rand(4, S_CACHE, H_KV, D)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=i32(SEQLENS),
                                  cache_batch_idx=i32(BATCH_IDX), cache_leftpad=i32(LEFTPAD),
                                  causal=True)
    hi, lo = _kvcache_oracle(q, before_k, before_v, k_new, v_new, BATCH_IDX, SEQLENS, LEFTPAD)
    assert_close("out", out, hi, lo)


@pytest.mark.parametrize("target", ["block_table", "cache_seqlens"])
@pytest.mark.parametrize("seed", seeds())
def test_kvcache_paged(target, seed, unchecked):
    gen = torch.Generator().manual_seed(seed)
    q = rand(B, 1, H, D)
    k_pool, v_pool, table = _paged_pool()
    k_new, v_new = rand(B, 1, H_KV, D), rand(B, 1, H_KV, D)
    args = dict(block_table=table, cache_seqlens=i32(SEQLENS))
    args[target] = bad_values(args[target], PAGES if target == "block_table" else PAGE, gen)

    def run():
        return flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, causal=True, **args)

    out = call_or_clear_error(run, [target, "block_table"])
    assert out is None or out.shape == q.shape
    k_pool, v_pool, table = _paged_pool()
    out = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=i32(SEQLENS),
                                  block_table=table, causal=True)
    for b, n in enumerate(SEQLENS):
        if n == 0:  # no key: output 0
            assert not out[b].any()
            continue
        k, v = _gather(k_pool, table[b:b + 1], [n]), _gather(v_pool, table[b:b + 1], [n])
        hi = attention_ref(q[b:b + 1].double(), k[None].double(), v[None].double(),
                           causal=True)[0]
        lo = attention_ref(q[b:b + 1], k[None], v[None], causal=True, upcast=False)[0]
        assert_close(f"out[{b}]", out[b:b + 1], hi, lo)


# ---------------------------------------------------------------------------------------------
# flex: a BlockMask's counts and indices (forward and backward)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                    "full_kv_indices", "q_num_blocks", "q_indices"])
@pytest.mark.parametrize("seed", seeds(cpu=CPU_SEEDS[:1]))  # (the interpreter's slowest)
def test_flex_block_mask(target, seed):
    from solattn.flex import create_block_mask, flex_attention

    gen = torch.Generator().manual_seed(seed)
    L, BLOCK = 48, 16
    q, k, v = (rand(1, H, L, D, requires_grad=True) for _ in range(3))
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, H, L, L, device=DEVICE,
                           BLOCK_SIZE=BLOCK)
    listed = getattr(bm, target)
    if listed is None:
        pytest.skip(f"this BlockMask has no {target}")
    listed.copy_(bad_values(listed, L // BLOCK, gen))

    def run():
        out = flex_attention(q, k, v, block_mask=bm)
        out.float().sum().backward()
        return out

    out = call_or_clear_error(run, [target, "block_mask"])
    assert out is None or out.shape == q.shape
    good = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, H, L, L, device=DEVICE,
                             BLOCK_SIZE=BLOCK)
    out = flex_attention(q, k, v, block_mask=good)
    hi = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True)[0]
    lo = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, upcast=False)[0]
    assert_close("out", out.transpose(1, 2), hi, lo)


# The same on the Hopper flex kernels (sm_90: head dim 64, 128-blocks, forced onto them): the
# listed block indices reach the TMA loads, the dQ atomics and the mods' gathers (a document
# mask reads its captured ids at the listed rows and keys, ALiBi its slopes).
HOPPER_L, HOPPER_D, HOPPER_BLOCK = 384, 64, 128
BLOCK_MASK_LISTS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


def _hopper_flex_mods(kind: str):
    """``(score_mod, mask_mod)`` of a fuzz case: a plain causal mask, or causal documents (ids
    gathered per query and key) with ALiBi (slopes gathered per head)."""
    from solattn.flex.examples import alibi, causal, document_causal

    if kind == "causal":
        return None, causal
    doc_ids = (torch.arange(HOPPER_L, device=DEVICE) >= 200).to(torch.int32)
    slopes = torch.rand(H, device=DEVICE) * 0.1
    return alibi(slopes), document_causal(doc_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the Hopper flex kernels need sm_90")
@pytest.mark.parametrize("kind", ["causal", "document+alibi"])
@pytest.mark.parametrize("target", BLOCK_MASK_LISTS)
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_flex_block_mask_hopper(target, kind, seed):
    from solattn.dispatch import forced_backend
    from solattn.flex import create_block_mask, flex_attention
    from solattn.reference import flex_attention_ref

    gen = torch.Generator().manual_seed(seed)
    score_mod, mask_mod = _hopper_flex_mods(kind)
    q, k, v = (rand(1, H, HOPPER_L, HOPPER_D, requires_grad=True) for _ in range(3))

    def block_mask():
        return create_block_mask(mask_mod, 1, H, HOPPER_L, HOPPER_L, device=DEVICE,
                                 BLOCK_SIZE=HOPPER_BLOCK)

    bm = block_mask()
    listed = getattr(bm, target)
    if listed is None:
        pytest.skip(f"this BlockMask has no {target}")
    listed.copy_(bad_values(listed, HOPPER_L // HOPPER_BLOCK, gen))

    def run():
        with forced_backend("hopper"):
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
            out.float().sum().backward()
        return out

    out = call_or_clear_error(run, [target, "block_mask"])
    assert out is None or out.shape == q.shape
    with forced_backend("hopper"):
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask())
    hi = flex_attention_ref(q.double(), k.double(), v.double(), score_mod, mask_mod)[0]
    lo = flex_attention_ref(q, k, v, score_mod, mask_mod, upcast=False)[0]
    assert_close("out", out, hi, lo)


# ---------------------------------------------------------------------------------------------
# FP8 varlen (Hopper): the transposed-V copy and the forward read cu_seqlens_q/k, seqused_k
# ---------------------------------------------------------------------------------------------

FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the FP8 kernels need sm_90")
@pytest.mark.parametrize("target", ["cu_seqlens_q", "cu_seqlens_k"])  # (no seqused_k with FP8)
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_fp8_varlen(target, seed):
    from test_fp8 import fp8_twin

    gen = torch.Generator().manual_seed(seed)
    d = 64
    q8 = rand(sum(LENS_Q), H, d).to(FP8)
    k8, v8 = (rand(sum(LENS_K), H_KV, d).to(FP8) for _ in range(2))
    args = dict(cu_seqlens_q=_cu(LENS_Q), cu_seqlens_k=_cu(LENS_K))
    args[target] = bad_values(args[target], sum(LENS_K), gen)

    def run():
        return flash_attn_varlen_func(q8, k8, v8, args["cu_seqlens_q"], args["cu_seqlens_k"],
                                      max(LENS_Q), max(LENS_K), causal=True)

    out = call_or_clear_error(run, [target])
    assert out is None or out.shape == q8.shape
    # a valid call afterwards matches the oracle of the e4m3 values, per sequence (and the
    # twin with the FP8 kernel's roundings: test_fp8.fp8_twin)
    cu_q, cu_k = _cu(LENS_Q).tolist(), _cu(LENS_K).tolist()
    out = flash_attn_varlen_func(q8, k8, v8, _cu(LENS_Q), _cu(LENS_K), max(LENS_Q),
                                 max(LENS_K), causal=True)
    for b in range(len(LENS_Q)):
        qb, kb, vb = (t[lo:hi][None].float() for t, lo, hi in (
            (q8, cu_q[b], cu_q[b + 1]), (k8, cu_k[b], cu_k[b + 1]), (v8, cu_k[b], cu_k[b + 1])))
        hi = attention_ref(qb.double(), kb.double(), vb.double(), causal=True)[0]
        assert_close(f"out[{b}]", out[cu_q[b]:cu_q[b + 1]][None], hi,
                     fp8_twin(qb, kb, vb, causal=True), eps=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the FP8 kernels need sm_90")
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_fp8_v_transpose_varlen_stays_inside(seed):
    """The transposed-V copy with invalid ``cu_seqlens_k``: it writes inside its ``(h_kv, d,
    s_pad)`` output only (guard bytes on both sides stay as they were), and reads V's rows
    only (compute-sanitizer's memcheck checks that part: tools/gpu_robustness.sh)."""
    from solattn.kernels.hopper.forward import fp8_v_transpose_varlen_kernel

    gen = torch.Generator().manual_seed(seed)
    lens, h_kv, d, guard = [5, 0, 100, 33], 2, 64, 4096
    v = rand(sum(lens), h_kv, d).to(FP8)
    cu = bad_values(_cu(lens), sum(lens), gen)
    s_pad = (sum(lens) + 31) // 32 * 32 + 32 * len(lens)
    n = h_kv * d * s_pad
    buf = torch.full((guard + n + guard,), 0x5A, dtype=torch.uint8, device=DEVICE)
    vt = buf[guard:guard + n].view(h_kv, d, s_pad)
    fp8_v_transpose_varlen_kernel[(4, len(lens) * h_kv)](
        v.view(torch.uint8), vt, cu, len(lens), sum(lens), s_pad, h_kv, v.stride(0),
        v.stride(1), HEAD_DIM=d, BLOCK_K=128, TAIL=128)
    torch.cuda.synchronize()
    assert (buf[:guard] == 0x5A).all() and (buf[guard + n:] == 0x5A).all()
