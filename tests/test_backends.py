"""Kernel dispatch: forced backends, and the fallback when a specialized kernel does not compile.

The fallback test runs anywhere (the interpreter on CPU): the dispatcher is told the Hopper
kernel covers the call and the Hopper launcher raises the compile error Triton 3.9 raised for
Gluon names that moved, so the call must run the portable kernel, warn once, and not retry.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from oracle import assert_close, randn
from triton.compiler.errors import CompilationError

from solattn import dispatch, flash_attn_func
from solattn.dispatch import forced_backend
from solattn.kernels.hopper import forward_plan as hopper
from solattn.reference import attention_ref


@pytest.fixture
def broken_hopper(monkeypatch):
    """Hopper 'covers' every call, and its launcher fails to compile; returns the call log."""
    calls = []

    def fail(*args, **kwargs):
        calls.append(args[0].shape)
        err = CompilationError(None, None, "at 60:8: tma.async_copy_global_to_shared(...)")
        raise err from RuntimeError(
            "async_copy_global_to_shared has been removed; call async_load instead")

    monkeypatch.setattr(dispatch, "hopper_unavailable", lambda arch, device=None: "")
    monkeypatch.setattr(hopper, "covers", lambda q, v, p: (True, "test"))
    monkeypatch.setattr(hopper, "attn_fwd", fail)
    monkeypatch.setattr(dispatch, "_BROKEN", {})
    monkeypatch.setattr(dispatch, "_WARNED", set())
    dispatch._DECISIONS.clear()  # decisions made before the patches
    yield calls
    dispatch._DECISIONS.clear()


def test_compile_failure_falls_back_to_portable_with_one_warning(broken_hopper):
    q, k, v = randn(1, 33, 2, 32), randn(1, 40, 2, 32), randn(1, 40, 2, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = flash_attn_func(q, k, v, causal=True)
        again = flash_attn_func(q, k, v, causal=True)
        other = flash_attn_func(q, k, v)  # another variant: tried once, no second warning
    mine = [w for w in caught if "Hopper" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    msg = str(mine[0].message)
    assert "triton" in msg and "async_copy_global_to_shared has been removed" in msg
    assert len(broken_hopper) == 2  # causal once, non-causal once: each decision is cached
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_lo, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close("out", out, ref, ref_lo)
    assert torch.equal(out, again)
    ref, _ = attention_ref(q, k, v)
    ref_lo, _ = attention_ref(q, k, v, upcast=False)
    assert_close("out", other, ref, ref_lo)


def test_forced_hopper_raises_the_compile_error(broken_hopper):
    q = randn(1, 16, 2, 32)
    with forced_backend("hopper"), pytest.raises(RuntimeError, match="failed to compile"):
        flash_attn_func(q, q, q)
    # once known broken, a forced call is refused before any compile
    with forced_backend("hopper"), pytest.raises(NotImplementedError, match="did not compile"):
        flash_attn_func(q, q, q)
    assert len(broken_hopper) == 1


def test_forced_backend_validates_and_nests():
    with pytest.raises(ValueError, match="backend"):
        with forced_backend("cudnn"):
            pass
    with forced_backend("portable"):
        assert dispatch.requested_backend() == "portable"
        with forced_backend("hopper"):
            assert dispatch.requested_backend() == "hopper"
        assert dispatch.requested_backend() == "portable"
