"""Small Hopper-forward calls for compute-sanitizer (memcheck / racecheck) runs (dev helper)."""
import dataclasses

import torch

from solattn.core import make_params
from solattn.kernels.hopper import forward_plan as F

torch.manual_seed(0)
# (head dim, causal, persistent, O staged in its own tile: HopperFwdConfig.o_staging; the
# causal staged call claims its tiles)
for d, causal, persistent, staged in [(128, True, False, False), (64, False, True, False),
                                      (128, False, True, True), (128, False, True, False),
                                      (128, True, True, True)]:
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16)
    picked = F.hopper_fwd_config(d, causal)
    cfg = dataclasses.replace(picked, persistent=persistent, o_staging=staged,
                              dynamic=staged and causal, stages=2 if staged else picked.stages)
    out, lse = F.attn_fwd(q, k, v, make_params(q, k, causal=causal), return_lse=True, config=cfg)
    torch.cuda.synchronize()
    print(f"d{d} causal={causal} persistent={persistent} staged={staged}: "
          f"finite={bool(out.isfinite().all())}")
