"""racecheck control: a Gluon warp-specialized kernel that declares no shared memory at all.

The Hopper forward's racecheck report lists RAW hazards on a few shared-memory bytes past the
kernel's own buffers (see docs/hopper-forward.md). If this kernel, whose partitions only store
registers to global memory, reports hazards at the same kind of address, they belong to Triton's
warp-specialization scaffolding (the state the default partition hands to the workers), not to the
attention kernel. ``--barrier`` adds one ``gl.thread_barrier()`` per partition (a
partition-local ``bar.sync id, 128``, as the forward's partitions have) to test whether those
make racecheck flag the scaffolding. Run under compute-sanitizer on the GPU:

    compute-sanitizer --tool racecheck python3 tools/ws_race_probe.py
    compute-sanitizer --tool racecheck python3 tools/ws_race_probe.py --barrier

Measured on an H100 (2026-11-22, triton 3.6.0): 0 hazards without ``--barrier``; 4 with it, all
"read at kernel entry / written at the ``warp_specialize`` line" on the dispatch bytes, the same
pattern as the forward's reports.
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default_part(out, scale, BARRIER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, 32 * gl.num_warps(), layout)
    if BARRIER:
        gl.thread_barrier()
    gl.store(out + offs, offs.to(gl.float32) * scale)


@gluon.jit
def _worker_part(out, scale, BASE: gl.constexpr, WARPS: gl.constexpr, BARRIER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    offs = gl.arange(0, 32 * WARPS, layout)
    if BARRIER:
        gl.thread_barrier()
    gl.store(out + BASE + offs, offs.to(gl.float32) * scale)


@gluon.jit
def ws_probe_kernel(out, scale, BARRIER: gl.constexpr):
    """Same partition shape as the forward: default 4 warps, workers of 4 and 1 warps."""
    gl.warp_specialize([
        (_default_part, (out, scale, BARRIER)),
        (_worker_part, (out, scale, 128, 4, BARRIER)),
        (_worker_part, (out, scale, 256, 1, BARRIER)),
    ], [4, 1], [240, 24])


if __name__ == "__main__":
    out = torch.zeros(288, device="cuda", dtype=torch.float32)
    ws_probe_kernel[(2,)](out, 2.0, BARRIER="--barrier" in sys.argv, num_warps=4)
    torch.cuda.synchronize()
    expect = torch.cat([torch.arange(128), torch.arange(128), torch.arange(32)]).float() * 2
    print("ws probe correct:", bool(torch.equal(out.cpu(), expect)))
