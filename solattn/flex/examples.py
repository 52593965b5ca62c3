"""A catalogue of FlexAttention mods in plain PyTorch, as users write them for torch's
``flex_attention``: the tests run each against the oracle, ``solattn aot`` compiles a few, and
``scripts/bench_flex.py`` times them. Factories return the mod (closures capture their tensors).
"""

from __future__ import annotations

import math

import torch

from solattn.flex.block_mask import and_masks, or_masks


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window: int):
    """Causal, at most ``window`` keys back."""
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return sliding_window_mask


def document(doc_ids: torch.Tensor):
    """Packed documents: a query sees keys of its own document (``doc_ids`` (L,) ints)."""
    def document_mask(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]
    return document_mask


def document_causal(doc_ids: torch.Tensor):
    return and_masks(causal, document(doc_ids))


def prefix_lm(prefix_len: torch.Tensor):
    """Bidirectional over each sequence's prefix (``prefix_len`` (B,)), causal after it."""
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_len[b])
    return prefix_lm_mask


def dilated(stride: int):
    """Causal, every ``stride``-th key."""
    def dilated_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) % stride == 0)
    return dilated_mask


def global_window(n_global: int, window: int):
    """Longformer-style: ``n_global`` tokens see and are seen by all, the rest a +-window."""
    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    def global_mask(b, h, q_idx, kv_idx):
        return (q_idx < n_global) | (kv_idx < n_global)
    return or_masks(global_mask, window_mask)


def tree(parent: torch.Tensor, depth: int):
    """Tree attention (speculative decoding): a token sees itself and its ancestors up to
    ``depth`` levels, following the captured ``parent`` array (the root is its own parent)."""
    def tree_mask(b, h, q_idx, kv_idx):
        node = q_idx
        keep = kv_idx == node
        for _ in range(depth):
            node = parent[node]
            keep = keep | (kv_idx == node)
        return keep
    return tree_mask


def alibi(slopes: torch.Tensor):
    """ALiBi as a score_mod: ``-slope[h] * |q - kv|`` (``slopes`` (H,))."""
    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi_mod


def softcap(cap: float):
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_mod


def relative_bias(table: torch.Tensor, seqlen: int):
    """Learnable relative-position bias: ``table[h, q - kv + seqlen - 1]`` (``table``
    (H, 2 * seqlen - 1), may require grad)."""
    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen - 1]
    return relative_bias_mod


def position_biases(slopes: torch.Tensor, q_scale: torch.Tensor, kv_bias: torch.Tensor):
    """Learnable ALiBi slopes (H,), a per-query temperature (L,) and a per-head key bias (H, L):
    their gradients gather over a whole tile, a row and a column (one atomic each). (A per-query
    *additive* bias would have a zero gradient: softmax ignores row shifts.)"""
    def position_biases_mod(score, b, h, q_idx, kv_idx):
        return (score * q_scale[q_idx] - slopes[h] * (q_idx - kv_idx).abs()
                + kv_bias[h, kv_idx])
    return position_biases_mod


def t5_bias(table: torch.Tensor, num_buckets: int = 32, max_distance: int = 128):
    """T5's bucketed relative bias (bidirectional): ``table`` (H, num_buckets)."""
    half = num_buckets // 2
    exact = half // 2
    log_ratio = math.log(max_distance / exact)

    def t5_mod(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        base = (rel > 0).to(torch.int32) * half
        n = rel.abs()
        large = exact + (torch.log(n.to(torch.float32) / exact) / log_ratio
                         * (half - exact)).to(torch.int32)
        large = torch.clamp(large, max=half - 1)
        bucket = base + torch.where(n < exact, n, large)
        return score + table[h, bucket]
    return t5_mod


def mods(L: int, H: int, B: int, device, dtype=torch.float32, requires_grad=False) -> dict:
    """``name -> (score_mod or None, mask_mod or None)``: the catalogue for ``(B, H, L, L)``
    problems, captured tensors made on ``device`` (seeded: deterministic)."""
    g = torch.Generator(device="cpu").manual_seed(1234)

    def randn(*shape, positive=False):
        t = torch.randn(*shape, generator=g) * 0.5
        t = (t.abs() if positive else t).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    n_docs = max(2, min(16, L // 8))
    doc_ids = torch.sort(torch.randint(0, n_docs, (L,), generator=g)).values.to(device)
    prefix = torch.randint(1, max(2, L // 2), (B,), generator=g).to(device)
    parent = torch.clamp(torch.arange(L) - torch.randint(1, 4, (L,), generator=g), min=0)
    parent[0] = 0
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1) / H).to(device)
    return {
        "causal": (None, causal),
        "sliding_window": (None, sliding_window(max(1, L // 4))),
        "document": (None, document(doc_ids)),
        "document_causal": (None, document_causal(doc_ids)),
        "prefix_lm": (None, prefix_lm(prefix)),
        "dilated": (None, dilated(3)),
        "global_window": (None, global_window(2, max(1, L // 8))),
        "tree": (None, tree(parent.to(device), 4)),
        "alibi_causal": (alibi(slopes), causal),
        "softcap": (softcap(5.0), None),
        "relative_bias": (relative_bias(randn(H, 2 * L - 1), L), None),
        "t5_bias": (t5_bias(randn(H, 32), 32, max(8, L)), None),
        "position_biases": (position_biases(randn(H, positive=True), randn(L, positive=True),
                                                randn(H, L)), causal),
        "softcap_window_and": (softcap(8.0), and_masks(causal, sliding_window(max(1, L // 3)))),
    }
