"""Shared test setup: device, dtypes, the tolerance rule against the one oracle.

On a machine without CUDA the suite runs in Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is imported; the Makefile does it) on small shapes in fp16 (Triton 3.6's
interpreter gave wrong bf16 results). With CUDA it runs bf16 and fp16 and the larger grid.
"""

from __future__ import annotations

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
