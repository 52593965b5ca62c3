"""The flex mod registry: a score_mod / mask_mod -> ``(key, captured tensors)``.

:func:`resolve` describes a mod (:mod:`solattn.flex.trace`), traces it once per description and
generates its device functions (:mod:`solattn.flex.codegen`); the key indexes
:data:`_REGISTRY`, the captured tensors are passed to the kernels, so their values are read at
run time (a new document layout reuses the same compiled kernel). Under ``torch.compile`` the
lookup runs once, at trace time (``assume_constant_result``), and the tensors become graph
inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from solattn.flex.codegen import STATS, ModFns, compile_mod
from solattn.flex.trace import MASK, SCORE, _cacheable, describe, trace

__all__ = ["MASK", "SCORE", "check_devices", "flat_args", "mask_fns_and_args", "mods", "resolve"]


_REGISTRY: list[ModFns] = []
_SPECS: dict = {}  # (kind, spec) -> (key, order)


def _register(fns: ModFns) -> int:
    key = getattr(fns, "key", None)
    if key is None:
        key = fns.key = len(_REGISTRY)
        _REGISTRY.append(fns)
    return key


def _jit_fns(fn, kind) -> ModFns:
    """A ``@triton.jit`` mod used as is (no captured tensors, no derivative)."""
    fns = ModFns(kind, getattr(fn, "__name__", "jit"), fn, None, ())
    fns.jit = True
    return fns


@torch._dynamo.assume_constant_result
def _lookup(kind: str, spec, fn) -> tuple:
    """``(registry key, order)`` of a described mod; traces and generates code on a miss."""
    cached = _SPECS.get((kind, spec))
    if cached is not None:
        return cached
    if spec[0] == "jit":
        result = (_register(_jit_fns(fn, kind)), ())
    else:
        if not _cacheable(spec) and torch.compiler.is_compiling():
            raise NotImplementedError(
                f"flex_attention under torch.compile: {kind} `{getattr(fn, '__name__', fn)}` "
                "reads an object solattn cannot fingerprint (only tensors, numbers, strings, "
                "functions, modules and tuples of them); capture the tensors it needs directly")
        tensors: list = []
        describe(fn, tensors)
        traced = trace(fn, kind, tensors)
        STATS["traced"] += 1
        result = (_register(compile_mod(traced)), traced.order)
    if _cacheable(spec):
        _SPECS[(kind, spec)] = result
    return result


def resolve(fn, kind: str) -> tuple[int, list]:
    """``(key, captured tensors)`` of a score_mod / mask_mod (Dynamo-traceable)."""
    tensors: list = []
    spec = describe(fn, tensors)
    key, order = _lookup(kind, spec, fn)
    return key, [tensors[i] for i in order]


def mods(key: int) -> Optional[ModFns]:
    return _REGISTRY[key] if key >= 0 else None


def mask_fns_and_args(mask_mod, device):
    """``(device function or None for a noop mask, ARGS tuple)`` of a mask_mod
    (create_block_mask's Triton path)."""
    key, caps = resolve(mask_mod, MASK)
    fns = _REGISTRY[key]
    check_devices(caps, device, "mask_mod")
    return (None if fns.noop else fns.fwd), flat_args(caps)


def flat_args(tensors) -> tuple:
    out = []
    for t in tensors:
        out += [t, *t.shape, *t.stride()]
    return tuple(out)


def _device_key(device) -> tuple:
    """``(type, index)`` with CUDA's default index resolved: ``cuda`` and ``cuda:0`` are one
    device when 0 is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index or 0)


def check_devices(caps, device, what):
    for t in caps:
        if t.device != device and _device_key(t.device) != _device_key(device):
            raise ValueError(f"{what}: captured tensor on {t.device}, expected {device} (the "
                             "query's device)")
