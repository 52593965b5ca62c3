"""Per-step timings of ring attention: how much of each step computes and how much waits.

Off unless asked for (no events, no synchronization)::

    from solattn.distributed import ring_profile

    with ring_profile() as prof:
        out = ring_attention(q, k, v, causal=True)
        out.backward(dout)
    print(prof.totals())   # {"fwd": {"compute_ms": ..., "wait_ms": ...}, "bwd": {...}}

Each step is split at marks recorded on the compute stream (CUDA events on a GPU, so a mark is
*when the GPU got there*; ``time.perf_counter`` on the CPU):

* ``compute``: the step's attention kernels (forward or backward pieces);
* ``merge``: folding the step's partial output into the running one (forward), or adding the
  step's dQ/dK/dV pieces into the fp32 accumulators (backward);
* ``wait``: until the K/V (and, in the backward, the dK/dV) that the next step needs have
  arrived: the *exposed* communication, i.e. what compute did not hide (including waiting for a
  peer that is still computing: imbalance shows up here too).

The backward has one more row (``step == num_steps``, no pieces): waiting for this rank's own
dK/dV to come home after the last step. On a GPU, host launch overhead that leaves the stream
idle also lands in the phase where it happens; the totals are per rank (compare ranks: the
slowest one sets the pace).
"""

from __future__ import annotations

import contextlib
import time

import torch

_ACTIVE: list["RingProfile"] = []  # module-global: autograd runs the backward on its own thread


class _StepTimer:
    """Marks of one step: ``mark(name)`` ends the phase ``name`` that began at the previous mark."""

    def __init__(self, phase: str, step: int, device: torch.device, pieces: int):
        self.phase, self.step, self.pieces = phase, step, pieces
        self.cuda = device.type == "cuda"
        self.marks = [("start", self._now())]

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def resolve(self) -> dict:
        row = dict(phase=self.phase, step=self.step, pieces=self.pieces)
        for (_, t0), (name, t1) in zip(self.marks, self.marks[1:]):
            ms = t0.elapsed_time(t1) if self.cuda else (t1 - t0) * 1e3
            row[f"{name}_ms"] = row.get(f"{name}_ms", 0.0) + ms
        return row


class RingProfile:
    """Collects one row per ring step (forward and backward) while it is active."""

    def __init__(self):
        self._timers: list[_StepTimer] = []

    def _start(self, phase: str, step: int, device: torch.device, pieces: int) -> _StepTimer:
        timer = _StepTimer(phase, step, device, pieces)
        self._timers.append(timer)
        return timer

    def steps(self) -> list[dict]:
        """``[{phase, step, pieces, compute_ms, merge_ms, wait_ms}, ...]`` in call order
        (synchronizes the GPU to read the events)."""
        if any(t.cuda for t in self._timers):
            torch.cuda.synchronize()
        return [t.resolve() for t in self._timers]

    def totals(self) -> dict:
        """Sums per phase: ``{"fwd": {"steps", "compute_ms", "merge_ms", "wait_ms"},
        "bwd": {...}}``."""
        out: dict = {}
        for row in self.steps():
            acc = out.setdefault(row["phase"], {"steps": 0})
            acc["steps"] += 1
            for key, val in row.items():
                if key.endswith("_ms"):
                    acc[key] = acc.get(key, 0.0) + val
        return out

    def clear(self) -> None:
        self._timers.clear()


@contextlib.contextmanager
def ring_profile():
    """Record per-step timings of every ring attention forward and backward run inside.

    Yields
    ------
    RingProfile
        Read it with :meth:`RingProfile.steps` (one row per step: ``phase``, ``step``,
        ``pieces``, ``compute_ms``, ``merge_ms``, ``wait_ms``) or :meth:`RingProfile.totals`
        (sums per phase). Reading synchronizes the GPU; recording does not.
    """
    prof = RingProfile()
    _ACTIVE.append(prof)
    try:
        yield prof
    finally:
        _ACTIVE.remove(prof)


def step_timer(phase: str, step: int, device: torch.device, pieces: int):
    """A :class:`_StepTimer` of the innermost active profile, or None (profiling off)."""
    return _ACTIVE[-1]._start(phase, step, device, pieces) if _ACTIVE else None
