"""Small Hopper-forward calls for compute-sanitizer (memcheck / racecheck) runs (dev helper)."""
import dataclasses
import math

import torch

from solattn.kernels.hopper import forward as F
from solattn.masking import window_params

torch.manual_seed(0)
for d, causal, persistent in [(128, True, False), (64, False, True), (128, False, True)]:
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16)
    hl, hr, lft, rgt = window_params(causal, (-1, -1))
    cfg = dataclasses.replace(F.hopper_fwd_config(d, hr), persistent=persistent)
    out, lse = F.attn_fwd(q, k, v, scale=1 / math.sqrt(d), has_left=hl, has_right=hr, left=lft,
                          right=rgt, softcap=0.0, alibi_slopes=None, return_lse=True, config=cfg)
    torch.cuda.synchronize()
    print(f"d{d} causal={causal} persistent={persistent}: finite={bool(out.isfinite().all())}")
