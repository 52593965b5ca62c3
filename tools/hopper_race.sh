#!/bin/bash
# racecheck each launch mode separately; full reports under $OUT (dev helper)
for mode in "128 1 0" "64 0 1" "128 0 1"; do
  set -- $mode
  timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --racecheck-report all \
    python - "$@" > "$OUT/race_d$1_c$2_p$3.txt" 2>&1 <<'PY'
import dataclasses, sys, torch
from solattn.kernels.hopper import forward_plan as F
from solattn.core import make_params
d, causal, pers = int(sys.argv[1]), bool(int(sys.argv[2])), bool(int(sys.argv[3]))
q = torch.randn(1, 200, 2, d, device="cuda", dtype=torch.bfloat16)
cfg = dataclasses.replace(F.hopper_fwd_config(d, causal), persistent=pers)
F.attn_fwd(q, q, q, make_params(q, q, causal=causal), return_lse=True, config=cfg)
torch.cuda.synchronize()
PY
  echo "d$1 causal=$2 persistent=$3: $(grep 'RACECHECK SUMMARY' $OUT/race_d$1_c$2_p$3.txt)"
done
