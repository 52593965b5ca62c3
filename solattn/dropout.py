"""Attention dropout's random state: one seed per call, drawn from torch's generator.

The kernels drop probability ``P[i, j]`` of (batch entry ``b``, query head ``h``) when output
``j % 4`` of the Philox4x32-7 draw keyed by the call's 64-bit seed at counter
``(j // 4, i, h, b)`` falls below ``dropout_p`` (:func:`solattn.kernels.common.dropout_keep`):
one draw (7 rounds of 32-bit multiplies) serves four consecutive keys of a row, each with a
full 31-bit threshold. The mask is a pure function of the seed and the element's coordinates,
so the backward regenerates exactly the forward's mask whatever its tiles, and no ``N x N`` mask
is ever stored. flash-attn 2 amortizes one draw over 16 elements with 8-bit thresholds, laid out
along its MMA fragments (a layout-dependent mapping; this one is coordinate-only).

Where the seed comes from (:func:`draw_seed`): ``torch.randint`` on the inputs' device, a
``(1,)`` int64 tensor that the kernels load. So

* results are reproducible under ``torch.manual_seed`` (which seeds the CUDA and CPU default
  generators), and successive calls differ: each call advances the device's default generator
  by one draw, as any torch random op does;
* there is no host synchronization: the seed never leaves the device (``.item()`` would wait
  for the GPU); the draw costs one tiny kernel launch per call with dropout;
* CUDA graphs capture it correctly: torch's generator hands each replay a fresh Philox offset,
  so replays draw fresh seeds (a seed read on the host would be frozen into the graph);
* used by ``flash_attn_func`` / ``flash_attn_varlen_func`` / ``attention`` (``dropout_p``) and
  by ``flex_attention`` (``kernel_options={"dropout_p": p}``): the same seed draw and the same
  mask function, so the two APIs drop the same elements under the same generator state;
* the ``torch.compile`` ops (``solattn::fwd``, ``solattn::flex_fwd``) take the seed as an
  input, so each op is a pure function of its inputs (a recomputation, e.g. activation
  checkpointing, sees the same mask);
  Inductor draws the seed with its own generator unless ``fallback_random`` is set, so compiled
  and eager runs use different masks.

flash-attn instead reserves an offset in the generator's Philox stream on the host
(``philox_cuda_state``) and keys its kernel by ``(seed, offset)``; the two give the same
guarantees, this one without touching generator internals from Python.
"""

from __future__ import annotations

import torch

# Keep threshold resolution: an element is kept when the top 31 bits of its 32-bit Philox output
# are >= round(dropout_p * 2**31).
THRESHOLD_BITS = 31


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh ``(1,)`` int64 seed on ``device`` from its default generator (no host sync)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def keep_threshold(dropout_p: float) -> int:
    """The kernels' integer threshold for ``dropout_p``."""
    return int(round(dropout_p * 2**THRESHOLD_BITS))


class DropoutFields:
    """The kernels' view of ``dropout_p`` for a parameter object that has one
    (:class:`solattn.params.AttnParams`, :class:`solattn.flex.ops.FlexParams`)."""

    __slots__ = ()
    dropout_p: float

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0

    @property
    def dropout_threshold(self) -> int:
        """Kernels keep an element whose Philox output's top 31 bits are >= this (0: keep all)."""
        return keep_threshold(self.dropout_p)

    @property
    def dropout_scale(self) -> float:
        """``1 / (1 - dropout_p)``: kept probabilities are scaled so the output's mean is the
        undropped output."""
        return 1.0 / (1.0 - self.dropout_p)
