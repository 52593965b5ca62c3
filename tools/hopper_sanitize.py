"""Small Hopper-forward calls for compute-sanitizer (memcheck / racecheck) runs (dev helper)."""
import dataclasses

import torch

from solattn.core import make_params
from solattn.kernels.hopper import forward_plan as F

torch.manual_seed(0)
# (head dim, causal, persistent, O staged in its own tile: HopperFwdConfig.o_staging, LPT head
# groups in MiB, FP8 inputs; the causal staged calls claim their tiles)
for d, causal, persistent, staged, lpt, fp8 in [
        (128, True, False, False, 0, False), (64, False, True, False, 0, False),
        (128, False, True, True, 0, False), (128, False, True, False, 0, False),
        (128, True, True, True, 0, False), (128, True, True, True, 1, False),
        (128, True, True, True, 0, True), (128, False, True, True, 0, True),
        (128, True, True, True, 1, True), (64, True, True, True, 1, True)]:
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16)
    kw = {}
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        kw = {f"{n}_descale": torch.ones(2, 2, device="cuda") for n in "qkv"}
    picked = F.hopper_fwd_config(d, causal, fp8=fp8)
    cfg = dataclasses.replace(picked, persistent=persistent, o_staging=staged,
                              dynamic=staged and causal, lpt=lpt,
                              stages=2 if staged and not fp8 else picked.stages)
    out, lse = F.attn_fwd(q, k, v, make_params(q, k, causal=causal, **kw), return_lse=True,
                          config=cfg)
    torch.cuda.synchronize()
    print(f"d{d} causal={causal} persistent={persistent} staged={staged} lpt={lpt} fp8={fp8}: "
          f"finite={bool(out.isfinite().all())}")
