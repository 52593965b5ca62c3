"""Which kernel runs a call: one registry, one place that knows about architectures.

``SOLATTN_BACKEND=portable|hopper`` (or the ``backend=`` argument of the internal entry points)
forces a choice; ``SOLATTN_DEBUG=1`` prints each decision and its reason to stderr.
"""

from __future__ import annotations

import os
import sys

import torch

from solattn.configs import interpreting

BACKENDS = ("portable", "hopper")


def device_arch(device: torch.device) -> int:
    """Compute capability as an int (90 for sm_90). CPU tensors (the interpreter) report 90."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _debug(msg: str) -> None:
    if os.environ.get("SOLATTN_DEBUG", "0") not in ("", "0"):
        print(f"[solattn] {msg}", file=sys.stderr)


def requested_backend(backend: str | None = None) -> str | None:
    choice = backend or os.environ.get("SOLATTN_BACKEND") or None
    if choice is not None and choice not in BACKENDS:
        raise ValueError(
            f"backend: expected one of {BACKENDS} (or SOLATTN_BACKEND unset), got {choice!r}"
        )
    return choice


def select_forward(
    q: torch.Tensor,
    *,
    head_dim: int,
    head_dim_v: int,
    varlen: bool,
    has_alibi: bool,
    backend: str | None = None,
) -> str:
    """Name of the forward kernel for this call: ``"hopper"`` where it covers it, else
    ``"portable"``."""
    choice = requested_backend(backend)
    arch = device_arch(q.device)
    hopper_ok, why = _hopper_covers(q, arch, head_dim, head_dim_v, varlen, has_alibi)
    if choice == "hopper" and not hopper_ok:
        raise NotImplementedError(f"backend='hopper' cannot run this call: {why}")
    if choice is None:
        choice = "hopper" if hopper_ok else "portable"
    _debug(f"forward -> {choice} (arch sm_{arch}; hopper: {why})")
    return choice


def _hopper_covers(q, arch, head_dim, head_dim_v, varlen, has_alibi) -> tuple[bool, str]:
    if interpreting() or q.device.type != "cuda":
        return False, "needs a CUDA device (not the interpreter)"
    if arch != 90:
        return False, f"needs sm_90, device is sm_{arch}"
    try:
        from solattn.kernels.hopper import forward as hopper_forward
    except ImportError as exc:  # Gluon missing from this Triton
        return False, f"Gluon unavailable ({exc})"
    return hopper_forward.covers(
        q, head_dim=head_dim, head_dim_v=head_dim_v, varlen=varlen, has_alibi=has_alibi
    )
