"""The suites of ``solattn bench --suite NAME``, in the order ``solattn bench --list`` prints
them. Each is data (rows of shapes and calls, the peers that are its columns) run by
:mod:`solattn.bench.suite`."""

from __future__ import annotations

from ..suite import Suite
from . import cold_start, dense, flex, fp8, host, model, ring, varlen
from .decode import DECODE

SUITES: dict[str, Suite] = {s.name: s for s in [
    dense.FORWARD,
    dense.BACKWARD,
    dense.LAYER,
    DECODE,
    flex.FLEX,
    fp8.FP8,
    dense.DROPOUT,
    dense.PACKED,
    varlen.PAGED_VARLEN,
    dense.SDPA_MASK,
    dense.SMALL_Q,
    varlen.VARLEN,
    dense.FEATURES_SUITE,
    model.MODEL,
    Suite("ring", "ring attention forward + backward across the GPUs of torchrun's ranks, "
          "against one GPU on the whole sequence (TFLOP/s)", run=ring.run,
          command="torchrun --nproc_per_node 2 -m solattn.cli bench --suite ring"),
    host.HOST,
    Suite("cold-start", "the first calls of fresh processes: seconds, and kernels compiled or "
          "loaded, with an empty Triton cache and then with it filled", run=cold_start.run),
]}
# `solattn bench` without --suite: BENCHMARKS.md's anchors.
ANCHORS = ("forward", "backward", "decode")
