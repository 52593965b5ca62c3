"""Host time of ``flash_attn_func`` forward + backward per layer when a model's N layers call it
with their own tensors, as a training step does (each layer's q, k, v live at their own
addresses, and the caching allocator hands the same ones back step after step).

    python3 tools/host_layers.py [--layers 1,22] [--sizes 16,512] [--steps 200] [--blocks 10]

Per (layers, ``solattn.launch.DESCRIPTOR_CACHE_SIZE``) in a fresh process: B1 L128 H8 D64
causal bf16 (host-bound: the GPU work is a few microseconds), each step runs every layer's
forward then the backwards in reverse order (``torch.autograd.backward`` on the sum of the
layers' outputs: the autograd engine's thread runs them, as in a model); host time per layer
and step = wall time / (steps * layers), the median of ``--blocks`` blocks. SDPA's cuDNN and
flash backends on the same tensors in the same process for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, statistics, time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import solattn.launch
solattn.launch.DESCRIPTOR_CACHE_SIZE = {size}
from solattn import flash_attn_func
layers, steps, blocks = {layers}, {steps}, {blocks}
B, L, H, D = 1, 128, 8, 64
xs = [[torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
       for _ in range(3)] for _ in range(layers)]
def ours():
    outs = [flash_attn_func(q, k, v, causal=True) for q, k, v in xs]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
def sdpa(backend):
    def run():
        with sdpa_kernel(backend):
            outs = [F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=True)
                    for q, k, v in xs]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return run
res = dict()
for name, fn in (("solattn", ours), ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
                 ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION))):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(steps // blocks):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / (steps // blocks) / layers * 1e6)
    res[name] = statistics.median(times)
print("RESULT" + json.dumps(res))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="1,22")
    p.add_argument("--sizes", default="16,512", help="DESCRIPTOR_CACHE_SIZE values")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    rows = []
    for rnd in range(args.rounds):
        sizes = args.sizes.split(",")
        for layers in args.layers.split(","):
            for size in (sizes if rnd % 2 == 0 else sizes[::-1]):
                code = WORKER.format(size=int(size), layers=int(layers), steps=args.steps,
                                     blocks=args.blocks)
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True)
                found = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
                if not found:
                    print(f"layers={layers} size={size}: failed\n{proc.stderr[-2000:]}")
                    continue
                row = dict(json.loads(found[0][len("RESULT"):]), layers=int(layers),
                           size=int(size), round=rnd)
                rows.append(row)
                print(f"round {rnd} layers {layers:>3} cache {size:>4}: solattn "
                      f"{row['solattn']:6.1f} us a layer (fwd+bwd), sdpa cudnn "
                      f"{row['sdpa_cudnn']:6.1f}, flash {row['sdpa_flash']:6.1f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_layers.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for layers in sorted({r["layers"] for r in rows}):
        for size in sorted({r["size"] for r in rows}):
            v = [r["solattn"] for r in rows if r["layers"] == layers and r["size"] == size]
            if v:
                print(f"layers {layers:>3} cache {size:>4}: median {statistics.median(v):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
