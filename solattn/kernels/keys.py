"""Triton cache keys of solattn's kernels, computed once per process in one fixed order.

Triton (3.6 to 3.9) hashes a ``@triton.jit`` function's source together with the constexpr
globals its callees read (``LOG2E``...), but ``JITFunction.cache_key`` merges a callee's globals
into its caller's key before it computes that callee's own key: a callee hashed for the first
time contributes none. A kernel's key, and so the file Triton's on-disk cache stores its binary
under, thus depends on which kernels the process hashed before it. ``solattn warmup`` compiles
in one process what a user's process later looks up: both hash every kernel here, in this
order, before their first launch (:func:`primed` on each launcher), so their keys agree
whatever a program launches first.
"""

from __future__ import annotations

import functools
import importlib

# (module, kernel) in hashing order; a module that does not import with this Triton (Gluon)
# is skipped, the same way in every process of one install.
KERNELS = (
    ("solattn.kernels.triton.forward", "attn_fwd_kernel"),
    ("solattn.kernels.triton.forward", "attn_fwd_flex_kernel"),
    ("solattn.kernels.triton.backward", "attn_bwd_preprocess_kernel"),
    ("solattn.kernels.triton.backward", "attn_bwd_dkdv_kernel"),
    ("solattn.kernels.triton.backward", "attn_bwd_dq_kernel"),
    ("solattn.kernels.triton.backward", "attn_bwd_dkdv_flex_kernel"),
    ("solattn.kernels.triton.backward", "attn_bwd_dq_flex_kernel"),
    ("solattn.kernels.triton.decode", "decode_kernel"),
    ("solattn.kernels.triton.combine", "combine_kernel"),
    ("solattn.kernels.triton.rotary", "rotary_q_kernel"),
    ("solattn.kernels.triton.rotary", "append_kv_kernel"),
    ("solattn.kernels.hopper.forward", "attn_fwd_kernel"),
    ("solattn.kernels.hopper.backward", "bwd_preprocess_kernel"),
    ("solattn.kernels.hopper.backward", "attn_bwd_kernel"),
    ("solattn.kernels.hopper.forward", "attn_fwd_fp8_kernel"),
)
_done = False


def prime_cache_keys() -> None:
    """Hash every kernel of :data:`KERNELS`, in order (once per process)."""
    global _done
    if _done:
        return
    _done = True
    from solattn.device import interpreting

    if interpreting():  # TRITON_INTERPRET=1: kernels are interpreted, nothing is hashed
        return
    for module, name in KERNELS:
        try:
            mod = importlib.import_module(module)
        except ImportError:  # e.g. no Gluon in this Triton: skipped alike everywhere
            continue
        getattr(mod, name).cache_key  # noqa: B018 - computed for its side effect


def primed(launcher):
    """Decorate a kernel launcher: :func:`prime_cache_keys` runs before its first launch."""
    @functools.wraps(launcher)
    def run(*args, **kwargs):
        if not _done:
            prime_cache_keys()
        return launcher(*args, **kwargs)
    return run
