"""Shared test setup: device, dtypes, the tolerance rule against the one oracle.

On a machine without CUDA the suite runs in Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is imported; the Makefile does it) on small shapes in fp16 (Triton 3.6's
interpreter gave wrong bf16 results). With CUDA it runs bf16 and fp16 and the larger grid.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from oracle import ON_GPU

if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    raise RuntimeError("no CUDA device: run the tests with TRITON_INTERPRET=1 (see `make test`)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_plans():
    """Launch plans hold the config and kernel objects they were built with: tests that patch
    those start and end with no plans."""
    from solattn import launch

    launch.clear_plans()
    yield
    launch.clear_plans()


@pytest.fixture
def atomic_dq(monkeypatch, fresh_plans):
    """Make the default (non-deterministic) backward accumulate dQ with fp32 atomics, which no
    GPU config table picks, so that ``deterministic=False`` and ``True`` run different dQ code.
    Returns the list of dQ-kernel launches, to check which path ran. Forces the portable
    backend: on an sm_90 GPU the Hopper backward would run the covered calls."""
    from solattn import configs
    from solattn.kernels.triton import backward

    monkeypatch.setenv("SOLATTN_BACKEND", "portable")
    table_config = configs.bwd_config
    monkeypatch.setattr(configs, "bwd_config", lambda *a, **kw: dataclasses.replace(
        table_config(*a, **kw), atomic_dq=True))
    launches = []

    class DqKernelSpy:
        def __getitem__(self, grid):
            launches.append(grid)
            return dq_kernel[grid]

        def __getattr__(self, name):  # the rest (cache_key for keys.prime_cache_keys) as is
            return getattr(dq_kernel, name)

    dq_kernel = backward.attn_bwd_dq_kernel
    monkeypatch.setattr(backward, "attn_bwd_dq_kernel", DqKernelSpy())
    return launches
