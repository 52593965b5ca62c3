"""The normalized form of one attention call, built once on the host and passed to every launcher.

:func:`solattn.core.make_params` turns the user's arguments (flash-attn's ``dropout_p``,
``softmax_scale``, ``causal``, ``window_size``, ``softcap``, ``alibi_slopes``, varlen lengths, ...)
into one frozen :class:`AttnParams`. The portable forward and backward, the Hopper forward and
the decode kernel read their scalars and constexpr flags from it and compute no policy of their
own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from solattn.dropout import DropoutFields
from solattn.masking import window_params

LOG2E = math.log2(math.e)


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    """The softmax scale of a call: the user's, or flash-attn's default ``1 / sqrt(head_dim)``."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def _tensor_key(t: Optional[torch.Tensor]):
    """What a kernel launch depends on of an optional tensor argument besides its values."""
    return None if t is None else (t.dtype, tuple(t.shape), t.stride(), t.device)


@dataclass(frozen=True)
class AttnParams(DropoutFields):
    """Every choice of one attention call, normalized.

    Kernel-facing values are derived once in ``__post_init__``:

    * the band of the mask (:mod:`solattn.masking`): ``has_left`` / ``has_right`` and the
      sequence-independent offsets ``left`` / ``right`` (kernels add ``seqlen_k - seqlen_q`` of
      each sequence: bottom-right alignment);
    * the score scaling: kernels compute ``qk_scale * q.k`` (log2 units) without softcap, and
      ``qk_scale * tanh(softcap_prescale * q.k)`` with it;
    * the ALiBi slopes' ``(batch, head)`` strides (batch stride 0 for ``(h,)`` slopes);
    * dropout's integer keep threshold and output scale (properties);
    * ``launch_key``: every field a kernel launch depends on except the tensors' values (the
      scalars, flags, the output dtype, and the dtype, shape and strides of each optional
      tensor: slopes, cu_seqlens, seqused_k, block_table, dropout seed), hashable: part of the
      key of the launchers' plan caches (:mod:`solattn.launch`).
    """

    scale: float                      # softmax scale (default 1 / sqrt(head_dim))
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # flash-attn's (left, right); -1 unbounded
    softcap: float = 0.0              # 0: off
    alibi_slopes: Optional[torch.Tensor] = None  # (h,) or (b, h) float32
    group_size: int = 1               # query heads per KV head (GQA / MQA)
    deterministic: bool = False       # backward: bitwise-reproducible dQ (no float atomics)
    # Varlen: packed (t, h, d) tensors, sequence b at rows cu_seqlens[b]:cu_seqlens[b + 1].
    cu_seqlens_q: Optional[torch.Tensor] = None   # (b + 1,) int32
    cu_seqlens_k: Optional[torch.Tensor] = None   # (b + 1,) int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seqused_k: Optional[torch.Tensor] = None      # (b,) int32: keys used per batch entry
    # Forward output dtype, None = q's. float32 for callers that merge partial outputs (ring
    # attention): no rounding to q's dtype before the merge.
    out_dtype: Optional[torch.dtype] = None
    # Paged K/V (varlen only): k/v are page pools (num_pages, page_size, h_kv, d); key j of
    # sequence b is row j % page_size of page block_table[b, j // page_size].
    block_table: Optional[torch.Tensor] = None    # (b, max_pages_per_seq) int32, last stride 1
    # Attention dropout (training): probability of dropping each attention probability, and the
    # call's (1,) int64 seed on the inputs' device (solattn.dropout.draw_seed); None without.
    dropout_p: float = 0.0
    dropout_seed: Optional[torch.Tensor] = None
    # FP8 (float8_e4m3fn) inputs: the values are q * q_descale[b, h // group_size] (and so for k
    # and v); each a contiguous (b, h_kv) float32 tensor, or None for 1.
    q_descale: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None

    has_left: bool = field(init=False)
    has_right: bool = field(init=False)
    left: int = field(init=False)
    right: int = field(init=False)
    qk_scale: float = field(init=False)
    softcap_prescale: float = field(init=False)
    alibi_strides: tuple[int, int] = field(init=False)
    launch_key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        has_left, has_right, left, right = window_params(self.causal, self.window)
        if self.softcap > 0:
            qk_scale, prescale = self.softcap * LOG2E, self.scale / self.softcap
        else:
            qk_scale, prescale = self.scale * LOG2E, 1.0
        slopes = self.alibi_slopes
        if slopes is None:
            strides = (0, 0)
        elif slopes.dim() == 1:
            strides = (0, slopes.stride(0))
        else:
            strides = tuple(slopes.stride())
        launch_key = (self.scale, qk_scale, prescale, has_left, has_right, left, right,
                      self.softcap > 0, self.group_size, self.deterministic, self.max_seqlen_q,
                      self.max_seqlen_k, self.dropout_p, _tensor_key(slopes),
                      _tensor_key(self.cu_seqlens_q), _tensor_key(self.cu_seqlens_k),
                      _tensor_key(self.seqused_k), self.out_dtype, _tensor_key(self.block_table),
                      _tensor_key(self.dropout_seed), _tensor_key(self.q_descale),
                      _tensor_key(self.k_descale), _tensor_key(self.v_descale))
        for name, value in (("has_left", has_left), ("has_right", has_right),
                            ("left", left), ("right", right),
                            ("qk_scale", qk_scale), ("softcap_prescale", prescale),
                            ("alibi_strides", strides), ("launch_key", launch_key)):
            object.__setattr__(self, name, value)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0

    @property
    def has_alibi(self) -> bool:
        return self.alibi_slopes is not None

    @property
    def band(self) -> tuple[bool, bool, int, int]:
        """``(has_left, has_right, left, right)``: the mask's constexpr flags and offsets."""
        return self.has_left, self.has_right, self.left, self.right


@functools.lru_cache(maxsize=256)
def _scalar_params(scale, causal, window_left, window_right, softcap, group) -> AttnParams:
    """The :class:`AttnParams` of a KV-cache call without tensor-valued parameters (ALiBi)."""
    return AttnParams(scale=scale, causal=causal, window=(window_left, window_right),
                      softcap=softcap, group_size=group)


def decode_params(q, k_cache, alibi_slopes, softmax_scale, causal, window_left, window_right,
                  softcap) -> AttnParams:
    """The :class:`AttnParams` the decode kernels read for a call with these normalized
    arguments (kept per scalars where no tensor-valued parameter, ALiBi, is given)."""
    group = q.shape[2] // k_cache.shape[2]
    if alibi_slopes is None:
        return _scalar_params(softmax_scale, causal, window_left, window_right, softcap, group)
    return AttnParams(scale=softmax_scale, causal=causal, window=(window_left, window_right),
                      softcap=softcap, alibi_slopes=alibi_slopes, group_size=group)
