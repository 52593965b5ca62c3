"""torch.compile(fullgraph=True) through every public API: no graph break, same values.

The forward and backward are ``torch.library.custom_op``s with fake implementations, so Dynamo
traces a module that calls solattn into one graph (``fullgraph=True`` raises on any break) and
AOTAutograd differentiates it through ``register_autograd``. Runs on CPU under the interpreter
(Inductor compiles the surrounding graph for the CPU) and on GPU.
"""

from __future__ import annotations

import pytest
import torch
from oracle import DEVICE, DTYPES, ON_GPU, randn

from solattn import attention, flash_attn_func, flash_attn_kvpacked_func, flash_attn_varlen_func


class Block(torch.nn.Module):
    """A tiny attention block: projections around solattn, so the graph has real neighbours."""

    def __init__(self, api: str, d: int = 32, h: int = 4, h_kv: int = 2):
        super().__init__()
        self.api, self.h, self.h_kv, self.d = api, h, h_kv, d
        self.wq = torch.nn.Linear(d * h, d * h, bias=False)
        self.wkv = torch.nn.Linear(d * h, 2 * d * h_kv, bias=False)

    def forward(self, x, cu=None, max_len=None):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d)
        k, v = self.wkv(x).view(b, s, 2, self.h_kv, self.d).unbind(2)
        if self.api == "func":
            out, lse = flash_attn_func(q, k, v, causal=True, softcap=5.0, return_lse=True)
            return out.float().square().mean() + lse.mean()
        if self.api == "kvpacked":  # the fused K/V projection's output, unsplit
            kv = self.wkv(x).view(b, s, 2, self.h_kv, self.d)
            out = flash_attn_kvpacked_func(q, kv, causal=True)
            return out.float().square().mean()
        if self.api == "dropout":
            out = flash_attn_func(q, k, v, 0.25, causal=True)
            return out.float().square().mean()
        if self.api == "varlen":
            out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                         cu, cu, max_len, max_len, window_size=(8, 0))
            return out.float().square().mean()
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                        enable_gqa=True)
        return out.float().square().mean()


@pytest.mark.parametrize("dtype", DTYPES[:1] if not ON_GPU else DTYPES)
@pytest.mark.parametrize("api", ["func", "varlen", "attention", "kvpacked"])
def test_compile_fullgraph_matches_eager(api, dtype):
    torch.manual_seed(0)
    s = 64 if ON_GPU else 24
    model = Block(api).to(DEVICE, dtype)
    x = randn(2, s, 4 * 32, dtype=dtype)
    cu = torch.tensor([0, s - 5, 2 * s], device=DEVICE, dtype=torch.int32)
    args = (x, cu, s + 5) if api == "varlen" else (x,)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    loss_c = compiled(*args)
    loss_c.backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    loss_e = model(*args)
    loss_e.backward()
    grads_e = [p.grad for p in model.parameters()]

    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-3)
    for gc, ge in zip(grads_c, grads_e):
        assert torch.isfinite(gc).all()
        torch.testing.assert_close(gc, ge, rtol=2e-2, atol=2e-3)


def test_fake_impls_give_real_shapes():
    """The ops' fake (meta) implementations agree with the real outputs' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = randn(2, 9, 4, 32), randn(2, 11, 2, 32), randn(2, 11, 2, 48)
    seed = torch.tensor([7], device=DEVICE)
    # (..., cu_seqlens_k, dropout_seed, seqused_k, block_table, max_seqlen_q, ...)
    real_out, real_lse = torch.ops.solattn.fwd(q, k, v, None, None, None, seed, None, None, 9,
                                               11, 0.2, True, -1, -1, 0.0, False, 0.1)
    real_grads = torch.ops.solattn.bwd(real_out, q, k, v, real_out, real_lse, None, None, None,
                                       None, seed, None, None, 9, 11, 0.2, True, -1, -1, 0.0,
                                       False, 0.1)
    with FakeTensorMode() as mode:
        fq, fk, fv, fseed = (mode.from_tensor(t) for t in (q, k, v, seed))
        out, lse = torch.ops.solattn.fwd(fq, fk, fv, None, None, None, fseed, None, None, 9, 11,
                                         0.2, True, -1, -1, 0.0, False, 0.1)
        grads = torch.ops.solattn.bwd(out, fq, fk, fv, out, lse, None, None, None, None, fseed,
                                      None, None, 9, 11, 0.2, True, -1, -1, 0.0, False, 0.1)
    for fake, real in zip((out, lse, *grads), (real_out, real_lse, *real_grads)):
        assert fake.shape == real.shape and fake.dtype == real.dtype


def test_compile_dropout_fullgraph():
    """Dropout traces without a graph break: the seed is drawn in the graph and is an input of
    ``solattn::fwd`` (saved for ``solattn::bwd``). With Inductor's ``fallback_random`` the
    compiled graph draws the seed eager draws, so loss and gradients match eager's exactly."""
    s = 64 if ON_GPU else 24
    model = Block("dropout").to(DEVICE, torch.float16)
    x = randn(2, s, 4 * 32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    results = []
    for fn in (compiled, model):
        model.zero_grad()
        torch.manual_seed(11)
        loss = fn(x)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        model.zero_grad()
        torch.manual_seed(11)
        loss_c = compiled(x)
        loss_c.backward()
    (loss_any, _), (loss_e, grads_e) = results
    assert torch.isfinite(loss_any)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-3)
    for p, ge in zip(model.parameters(), grads_e):
        torch.testing.assert_close(p.grad, ge, rtol=2e-2, atol=2e-3)
