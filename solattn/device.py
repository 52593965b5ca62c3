"""The machine a call runs on: the GPU's exact compute capability, its SM count, whether
Triton's interpreter runs the kernels, and the installed Triton's version.

A leaf: it imports nothing of solattn, and every module that asks one of these questions asks it
here (the dispatcher, the config tables, the kernels' host plans, the AOT and warmup tools).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

# The compute capability the Gluon kernels (solattn.kernels.hopper) are written for: sm_90
# (H100, H200). solattn.dispatch is the one place that asks whether a device has it.
HOPPER_ARCH = 90

# What CPU tensors report (the interpreter's tests pick sm_90's paths and config tables, and
# 4 SMs so that work-splitting heuristics still split).
INTERPRETER_ARCH = 90
INTERPRETER_SMS = 4


def interpreting() -> bool:
    """True when Triton's CPU interpreter runs kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton: tables differ where a Triton release compiles a
    config differently (its ptxas or code generation), each such entry says what was measured."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device (``(9, 0)`` for an H100); CPU tensors (the
    interpreter) report :data:`INTERPRETER_ARCH`'s."""
    if device.type != "cuda":
        return divmod(INTERPRETER_ARCH, 10)
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> int:
    """The exact compute capability as an int: 90 for sm_90, 89 for sm_89, 120 for sm_120.
    CPU tensors (the interpreter) report :data:`INTERPRETER_ARCH`."""
    major, minor = compute_capability(device)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``. CPU tensors (the interpreter) report a small GPU
    of :data:`INTERPRETER_SMS` SMs, so work-splitting heuristics still split in CPU tests."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
