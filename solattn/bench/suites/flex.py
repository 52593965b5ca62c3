"""``flex``: ``solattn.flex_attention`` against torch's compiled ``flex_attention`` on the same
mods and inputs, forward and backward, and the dedicated dense kernel where one computes the
same attention. TFLOP/s count the blocks the BlockMask lists (torch's flex benchmarks'
convention: 4 B H L^2 d x block density, 2.5x that backward)."""

from __future__ import annotations

import torch

from ..peers import PeerUnavailable, flex_compiled
from ..suite import Row, Suite
from .common import needs_cuda, randn

WINDOW = 1024


def _doc_ids(L, device, n_docs=16):
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(L - 1, generator=g)[: n_docs - 1] + 1).values
    ids = torch.zeros(L, dtype=torch.int32)
    ids[cuts] = 1
    return torch.cumsum(ids, 0).to(torch.int32).to(device)


def _slopes(H, device):
    return torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)


def catalogue(L, H, B, device, window=WINDOW):
    """``name -> (score_mod or None, mask_mod)``: the mods the suite times."""
    from solattn.flex import examples as ex

    table = torch.randn(H, 2 * L - 1, device=device, generator=torch.Generator(
        device=device).manual_seed(3)) * 0.1
    prefix = torch.full((B,), L // 4, device=device, dtype=torch.int32)
    return {
        "causal": (None, ex.causal),
        "sliding_window": (None, ex.sliding_window(window)),
        "document": (None, ex.document_causal(_doc_ids(L, device, min(16, L // 8)))),
        "prefix_lm": (None, ex.prefix_lm(prefix)),
        "alibi": (ex.alibi(_slopes(H, device)), ex.causal),
        "softcap": (ex.softcap(30.0), ex.causal),
        "relative_bias": (ex.relative_bias(table, L), ex.causal),
    }


def dedicated(name, H, device, window=WINDOW):
    """``flash_attn_func`` keywords of the dedicated kernel computing mod ``name``, or None."""
    return {"causal": dict(causal=True),
            "sliding_window": dict(causal=True, window_size=(window, 0)),
            "alibi": dict(causal=True, alibi_slopes=_slopes(H, device).float()),
            "softcap": dict(causal=True, softcap=30.0)}.get(name)


def block_density(block_mask) -> float:
    """Listed (partial + full) key blocks over all key blocks of solattn's BlockMask."""
    n = block_mask.kv_num_blocks.sum().item()
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        n += block_mask.full_kv_num_blocks.sum().item()
    q_blocks = block_mask.kv_num_blocks.numel()
    kv_len = block_mask.seq_lengths[1] if hasattr(block_mask, "seq_lengths") else None
    bkv = block_mask.BLOCK_SIZE[1] if isinstance(block_mask.BLOCK_SIZE, tuple) \
        else block_mask.BLOCK_SIZE
    kv_blocks = -(-kv_len // bkv) if kv_len else block_mask.kv_indices.shape[-1]
    return n / (q_blocks * kv_blocks)


def _direction_fn(attn, q, k, v, direction):
    if direction == "fwd":
        def run():
            with torch.no_grad():
                return attn(q, k, v)
        return run
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attn(qq, kk, vv)
    do = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)


def _rows(ctx):
    import solattn
    from solattn.flex import create_block_mask, flex_attention

    lengths = [64] if ctx.cpu else ([4096] if ctx.quick else [4096, 16384])
    H, D = (2, 32) if ctx.cpu else (16, 128)
    for L in lengths:
        B = 1 if ctx.cpu else 16384 // L
        q, k, v = (randn(B, H, L, D, ctx=ctx, seed=i) for i in range(3))  # (b, h, s, d)
        window = 16 if ctx.cpu else WINDOW
        for name, (score_mod, mask_mod) in catalogue(L, H, B, ctx.device, window).items():
            bm = create_block_mask(mask_mod, B if name == "prefix_lm" else None, None, L, L,
                                   device=ctx.device,
                                   **({"BLOCK_SIZE": 16} if ctx.cpu else {}))
            flops = 4.0 * B * H * L * L * D * block_density(bm)
            kw = dedicated(name, H, ctx.device, window)

            def ours(q, k, v, score_mod=score_mod, bm=bm):
                return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

            def torch_flex_call(direction, score_mod=score_mod, mask_mod=mask_mod, name=name):
                def build():
                    needs_cuda(ctx)
                    try:
                        from torch.nn.attention.flex_attention import create_block_mask as tcbm
                    except ImportError as exc:
                        raise PeerUnavailable(f"torch has no flex_attention ({exc})") from exc
                    tbm = tcbm(mask_mod, B if name == "prefix_lm" else None, None, L, L,
                               device=ctx.device)
                    compiled = flex_compiled()
                    return _direction_fn(lambda q, k, v: compiled(
                        q, k, v, score_mod=score_mod, block_mask=tbm), q, k, v, direction)
                return build

            def dense_call(direction, kw=kw):
                def build():
                    if kw is None:
                        raise PeerUnavailable("no dedicated kernel for this mod")
                    return _direction_fn(lambda q, k, v: solattn.flash_attn_func(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw
                    ).transpose(1, 2), q, k, v, direction)
                return build

            for direction in ("fwd", "bwd"):
                ref = None
                if score_mod is None and direction == "fwd":
                    def ref(mask_mod=mask_mod):
                        from solattn.flex import create_mask

                        m = create_mask(mask_mod, B, H, L, L, device=ctx.device)
                        return torch.nn.functional.scaled_dot_product_attention(
                            q.double(), k.double(), v.double(), attn_mask=m)
                yield Row(f"B{B} H{H} L{L} D{D} {name}", {
                    "solattn": lambda direction=direction, ours=ours: _direction_fn(
                        ours, q, k, v, direction),
                    "flex": torch_flex_call(direction),
                    "solattn-dense": dense_call(direction)},
                    work=flops * (2.5 if direction == "bwd" else 1.0), section=direction,
                    meta=dict(b=B, h=H, s_q=L, s_k=L, d=D, mod=name), reference=ref)


def _block_mask_rows(ctx):
    """``create_block_mask`` itself (eager): solattn's against torch's, causal and documents."""
    from solattn.flex import create_block_mask

    for L in ([64] if ctx.cpu else [4096, 16384]):
        for name in ("causal", "document"):
            mask_mod = catalogue(L, 1, 1, ctx.device)[name][1]
            kw = {"BLOCK_SIZE": 16} if ctx.cpu else {}

            def torch_cbm(mask_mod=mask_mod, L=L):
                needs_cuda(ctx)
                try:
                    from torch.nn.attention.flex_attention import create_block_mask as tcbm
                except ImportError as exc:
                    raise PeerUnavailable(f"torch has no flex_attention ({exc})") from exc
                return lambda: tcbm(mask_mod, None, None, L, L, device=ctx.device)

            yield Row(f"create_block_mask L{L} {name}", {
                "solattn": lambda mask_mod=mask_mod, L=L: lambda: create_block_mask(
                    mask_mod, None, None, L, L, device=ctx.device, **kw),
                "flex": torch_cbm}, unit="ms", timer="wall", section="mask",
                meta=dict(s_q=L, s_k=L, mod=name))


def _all_rows(ctx):
    yield from _rows(ctx)
    yield from _block_mask_rows(ctx)


FLEX = Suite("flex", "FlexAttention mods (causal, sliding window, documents, prefix LM, ALiBi, "
             "softcap, a relative bias): solattn.flex_attention against torch's compiled "
             "flex_attention and solattn's dedicated kernel where one exists, forward and "
             "backward (TFLOP/s over the listed blocks); create_block_mask itself (ms)",
             ("solattn", "flex", "solattn-dense"), _all_rows, baseline="flex")
