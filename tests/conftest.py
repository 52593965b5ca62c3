"""Shared test setup: device, dtypes, the tolerance rule against the one oracle.

On a machine without CUDA the suite runs in Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is imported; the Makefile does it) on small shapes in fp16 (Triton 3.6's
interpreter gave wrong bf16 results), the grid's cases marked ``gpu_grid`` deselected (each runs
kernel code a kept case already runs; ``--full-grid`` keeps them). With CUDA it runs bf16 and
fp16 and the larger grid.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from oracle import ON_GPU

if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    raise RuntimeError("no CUDA device: run the tests with TRITON_INTERPRET=1 (see `make test`)")


def pytest_addoption(parser):
    parser.addoption("--full-grid", action="store_true",
                     help="keep the gpu_grid cases in the interpreter run (CPU) too")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_grid: a case of the full grid that runs the same kernel code as a case "
        "the interpreter keeps: deselected without a GPU (unless --full-grid)")


def pytest_collection_modifyitems(config, items):
    """Without a GPU: `gpu` tests are skipped (they need one), `gpu_grid` cases deselected (the
    interpreter's time goes to one case per kernel code path; the GPU suite runs them all)."""
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    kept, grid = [], []
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("gpu_grid") and not config.getoption("full_grid"):
            grid.append(item)
        else:
            kept.append(item)
    if grid:
        config.hook.pytest_deselected(items=grid)
        items[:] = kept


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
