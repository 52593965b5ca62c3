"""``solattn.attention`` with SDPA's ``attn_mask`` (bool or additive, broadcast shapes), forward
and backward against the float64 oracle (``reference.flex_attention_ref`` indexing the
broadcast mask itself), and the argument checks."""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, DTYPES, ON_GPU, assert_close, gpu_grid

from solattn import attention
from solattn.reference import flex_attention_ref

B, H, L, S, E = (2, 4, 300, 450, 64) if ON_GPU else (2, 2, 40, 56, 32)

SHAPES = {  # name -> mask shape (broadcast to (B, H, L, S))
    "2d": (L, S),
    "key_padding": (B, 1, 1, S),
    "full": (B, H, L, S),
    "per_head_rows": (1, H, L, 1),
    "3d": (H, L, S),
}


def make_mask(shape, kind, requires_grad=False):
    """A mask in which every (b, h, query) row keeps at least its first key (SDPA's math
    backend gives NaN for rows with none; solattn gives 0, tested separately)."""
    keep = torch.rand(shape, device=DEVICE) > 0.4
    keep[..., :1] = True
    if kind == "bool":
        return keep
    bias = torch.randn(shape, device=DEVICE, dtype=torch.float16 if not ON_GPU else DTYPES[0])
    bias = bias.masked_fill(~keep, float("-inf"))
    return bias.requires_grad_(requires_grad)


def oracle_mods(mask):
    """The oracle's own reading of SDPA's semantics: the mask broadcast to 4-D, indexed per
    score by flex_attention_ref's broadcast index tensors."""
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(B, H, L, S)
    if mask.dtype == torch.bool:
        return None, lambda b, h, q, kv: m4[b, h, q, kv]
    return (lambda s, b, h, q, kv: s + m4[b, h, q, kv]), None


def check(q, k, v, mask, *, enable_gqa=False):
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*xs, attn_mask=mask, enable_gqa=enable_gqa)
    dout = torch.randn_like(out)
    grads_mask = mask.dtype != torch.bool and mask.requires_grad
    if grads_mask:
        mask.grad = None
    (out.float() * dout.float()).sum().backward()
    got = [x.grad for x in xs] + ([mask.grad.clone()] if grads_mask else [])
    ref = {}
    for upcast in (True, False):
        ys = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if grads_mask:
            mask.grad = None
        score_mod, mask_mod = oracle_mods(mask)
        o, _ = flex_attention_ref(*ys, score_mod, mask_mod, upcast=upcast)
        (o * dout.to(o.dtype)).sum().backward()
        ref[upcast] = (o, [y.grad for y in ys] + ([mask.grad.clone()] if grads_mask else []))
    assert_close("out", out, ref[True][0], ref[False][0])
    for name, g, hi, lo in zip(("dq", "dk", "dv", "dmask"), got, ref[True][1], ref[False][1]):
        assert torch.isfinite(g).all(), name
        assert_close(name, g, hi, lo)


@pytest.mark.parametrize("kind", ["bool", "additive"])
# CPU: key_padding and 3d broadcast as 2d, per_head_rows and full do
@pytest.mark.parametrize("shape", ["2d", *gpu_grid("key_padding"), "full", "per_head_rows",
                                   *gpu_grid("3d")])
def test_attn_mask(shape, kind):
    torch.manual_seed(0)
    dtype = DTYPES[0]
    q = torch.randn(B, H, L, E, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, H, S, E, device=DEVICE, dtype=dtype) for _ in range(2))
    mask = make_mask(SHAPES[shape], kind)
    if kind == "additive":
        mask = mask.to(dtype)
    check(q, k, v, mask)


def test_additive_mask_gradient_and_gqa():
    """A learnable float mask gets its gradient (summed over its broadcast dims), with GQA."""
    torch.manual_seed(1)
    dtype = DTYPES[0]
    q = torch.randn(B, H, L, E, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, H // 2, S, E, device=DEVICE, dtype=dtype) for _ in range(2))
    mask = (0.5 * torch.randn(1, H, L, S, device=DEVICE)).to(dtype).requires_grad_()
    check(q, k, v, mask, enable_gqa=True)


def test_fully_masked_rows_give_zero():
    q = torch.randn(1, 1, 8, 32, device=DEVICE, dtype=DTYPES[0])
    k, v = (torch.randn(1, 1, 16, 32, device=DEVICE, dtype=DTYPES[0]) for _ in range(2))
    mask = torch.ones(8, 16, dtype=torch.bool, device=DEVICE)
    mask[3] = False
    out = attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[0, 0, 3], torch.zeros_like(out[0, 0, 3]))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           attn_mask=mask)
    keep = torch.arange(8, device=DEVICE) != 3
    assert (out[0, 0, keep].float() - ref[0, 0, keep]).abs().max().item() < 1e-2


def test_attn_mask_argument_checks():
    q = torch.randn(1, 2, 8, 32, device=DEVICE, dtype=DTYPES[0])
    k, v = (torch.randn(1, 2, 16, 32, device=DEVICE, dtype=DTYPES[0]) for _ in range(2))
    ok = torch.ones(8, 16, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="is_causal"):
        attention(q, k, v, attn_mask=ok, is_causal=True)
    with pytest.raises(NotImplementedError, match="deterministic"):
        attention(q, k, v, attn_mask=ok, deterministic=True)
    with pytest.raises(ValueError, match="broadcastable"):
        attention(q, k, v, attn_mask=torch.ones(8, 15, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="broadcastable"):
        attention(q, k, v, attn_mask=torch.ones(1, 1, 1, 8, 16, dtype=torch.bool,
                                                device=DEVICE))
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k, v, attn_mask=torch.ones(8, 16, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        attention(q, k, v, attn_mask=[[True]])


def test_sdpa_argument_order():
    """Positional arguments in SDPA's order: (q, k, v, attn_mask, dropout_p, is_causal)."""
    q = torch.randn(1, 2, 8, 32, device=DEVICE, dtype=DTYPES[0])
    k, v = (torch.randn(1, 2, 8, 32, device=DEVICE, dtype=DTYPES[0]) for _ in range(2))
    a = attention(q, k, v, None, 0.0, True)
    b = attention(q, k, v, is_causal=True)
    assert torch.equal(a, b)


def test_block_mask_reused_until_the_mask_changes(monkeypatch):
    """One mask tensor passed again (every layer of a model) reuses its BlockMask; an in-place
    write rebuilds it, and the output follows the new values."""
    from solattn.flex import sdpa_mask

    calls = []
    build = sdpa_mask.create_block_mask
    monkeypatch.setattr(sdpa_mask, "create_block_mask",
                        lambda *a, **kw: calls.append(1) or build(*a, **kw))
    q = torch.randn(1, 2, 24, 32, device=DEVICE, dtype=DTYPES[0])
    k, v = (torch.randn(1, 2, 24, 32, device=DEVICE, dtype=DTYPES[0]) for _ in range(2))
    mask = torch.ones(24, 24, dtype=torch.bool, device=DEVICE).tril()
    first = attention(q, k, v, attn_mask=mask)
    again = attention(q, k, v, attn_mask=mask)
    assert len(calls) == 1 and torch.equal(first, again)
    mask[:, 0] = False
    mask.fill_diagonal_(True)
    changed = attention(q, k, v, attn_mask=mask)
    assert len(calls) == 2
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           attn_mask=mask)
    assert (changed.float() - ref).abs().max().item() < 1e-2
    other = mask.clone()  # equal values, another tensor: built again
    attention(q, k, v, attn_mask=other)
    assert len(calls) == 3


def test_under_torch_compile_runs_eagerly():
    """Under torch.compile the masked call is a graph break (eager), with the eager result;
    fullgraph=True refuses it."""
    torch._dynamo.reset()
    q = torch.randn(1, 2, 40, 32, device=DEVICE, dtype=DTYPES[0])
    k, v = (torch.randn(1, 2, 48, 32, device=DEVICE, dtype=DTYPES[0]) for _ in range(2))
    mask = torch.rand(40, 48, device=DEVICE) > 0.3
    mask[:, 0] = True

    def fn(q, k, v, mask):
        return attention(q, k, v, attn_mask=mask) * 2

    want = fn(q, k, v, mask)
    assert torch.equal(torch.compile(fn)(q, k, v, mask), want)
    torch._dynamo.reset()  # (else the frame compiled above is reused)
    with pytest.raises(Exception, match="disable"):
        torch.compile(fn, fullgraph=True)(q, k, v, mask)
