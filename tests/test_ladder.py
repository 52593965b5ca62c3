"""The ladder's teaching kernels (solattn/bench/ladder.py) against the float64 oracle.

Each step runs its own device code (Triton's interpreter on CPU) on odd shapes: ragged tails,
several key blocks, GQA, causal with s_q < s_k and s_q > s_k (queries that see no key).
"""

from __future__ import annotations

import pytest
import torch
from oracle import DTYPES, ON_GPU, ON_SM90, assert_close, gpu_grid, randn

from solattn.bench import ladder
from solattn.bench.core import Inputs, Shape
from solattn.reference import attention_ref

TEACHING = ["naive", "cuda-cores", "tensor-cores", "pipelined", "exp2+skip"]
# (b, s_q, s_k, h, h_kv, d)
# CPU: the first (s_q < s_k, ragged blocks) runs the code the other two run (s_q > s_k with GQA;
# one row of s_k > s_q)
SHAPES = [*gpu_grid((1, 33, 47, 2, 2, 32)), (2, 47, 33, 4, 2, 16), (1, 1, 70, 1, 1, 64)]
if ON_GPU:
    SHAPES += [(2, 300, 555, 4, 2, 128), (1, 555, 300, 2, 1, 256), (1, 1000, 1000, 2, 2, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("step", TEACHING)
def test_step_matches_oracle(step, shape, causal, dtype):
    b, s_q, s_k, h, h_kv, d = shape
    q = randn(b, s_q, h, d, dtype=dtype)
    k = randn(b, s_k, h_kv, d, dtype=dtype)
    v = randn(b, s_k, h_kv, d, dtype=dtype)
    shp = Shape(b, h, s_q, s_k, d, causal=causal, h_kv=h_kv)
    attn = ladder.STEP_BY_NAME[step].setup(shp, Inputs(q, k, v))
    out = attn(q, k, v)
    hi, _ = attention_ref(q, k, v, causal=causal)
    lo, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close(f"{step} {shape} causal={causal}", out, hi, lo)


def test_registry_is_a_ladder():
    names = [s.name for s in ladder.STEPS]
    assert names[:5] == TEACHING
    for s in ladder.STEPS:
        assert s.vs is None or s.vs in {t.key for t in ladder.STEPS}, s
        assert s.change and s.seeds
    assert ladder.STEPS[0].vs is None


def test_teaching_kernels_reject_what_they_do_not_cover():
    q = randn(1, 8, 1, 48, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dims"):
        ladder.tensor_core_attention(q, q, q)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        ladder.cuda_core_attention(q.float(), q.float(), q.float())


def test_empty_query():
    q = randn(1, 0, 2, 32, dtype=torch.float16)
    k = randn(1, 5, 2, 32, dtype=torch.float16)
    assert ladder.tensor_core_attention(q, k, k).shape == q.shape
    assert ladder.cuda_core_attention(q, k, k).shape == q.shape


@pytest.mark.skipif(ON_SM90,
                    reason="the Hopper rows run on sm_90")
def test_hopper_rows_need_sm90():
    from solattn.bench.peers import PeerUnavailable

    with pytest.raises(PeerUnavailable, match="sm_90"):
        ladder.hopper_config_attention(Shape(1, 2, 64, 64, 128), persistent=True)



_COMPILE = """
from solattn.aot import compile_spec
from solattn.bench import ladder
for spec in ladder.aot_specs(90):
    res = compile_spec(spec, 90)
    ops = res.sass_ops
    print(spec.name, spec.config.replace(" ", "_"), int(res.failed),
          ops.get("HGMMA", 0) + ops.get("HMMA", 0), ops.get("LDGSTS", 0),
          res.line().replace(" ", "_"))
"""


@pytest.mark.skipif(ON_GPU, reason="compiled for real by the GPU run")
def test_teaching_kernels_compile_for_sm90():
    """Compiled for sm_90 with Triton's bundled ptxas, no GPU (a subprocess: the interpreter's
    jit functions cannot be compiled): tensor-core instructions in steps (c)-(e) and none in (b),
    cp.async rings in the pipelined ones, no local memory inside loops."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln.split() for ln in res.stdout.splitlines()]
    assert len(lines) == 8, res.stdout
    for name, config, failed, tensor_cores, cp_async, report in lines:
        assert failed == "0", report
        assert (int(tensor_cores) == 0) == (name == "ladder_cuda-cores"), report
        if "_s3" in config:
            assert int(cp_async) > 0, report


def test_hopper_config_rows_follow_the_launcher(monkeypatch):
    """The one-warpgroup and schedule rows reach the Hopper launcher's ``config=`` with the
    current signature (checked here without a GPU: the adapter is built, not run), and drop out
    with a reason when the launcher no longer takes one."""
    from solattn.bench.peers import PeerUnavailable

    hf = pytest.importorskip("solattn.kernels.hopper.forward_plan", reason="Gluon unavailable")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    causal = Shape(1, 2, 64, 64, 128, causal=True)
    default = hf.hopper_fwd_config(128, True)
    picks = {persistent: ladder.hopper_config_attention(causal, persistent=persistent)[1]
             for persistent in (True, False)}
    assert picks == {True: default.persistent, False: not default.persistent}
    assert default.consumers == 2
    assert ladder.hopper_config_attention(causal, consumers=1)[1] is False
    with pytest.raises(PeerUnavailable, match="no config with fields"):
        ladder.hopper_config_attention(causal, warpgroups=3)
    monkeypatch.setattr(hf, "attn_fwd", lambda q, k, v, **options: None)
    with pytest.raises(PeerUnavailable, match="Hopper launcher"):
        ladder.hopper_config_attention(causal, persistent=True)
