"""Ring attention (solattn.distributed) against the float64 oracle on the whole sequence.

Multi-process tests launch one subprocess per rank running this file as a script (``--worker``):
gloo on the CPU (``TRITON_INTERPRET=1`` set in the children's environment before anything imports
triton), NCCL on GPUs. One launch per world size runs every case of that world size (process
start-up dominates), rank 0 of each ring saves the gathered output, LSE and gradients, and the
test process applies flash-attn's rule (``assert_close``: within 2x PyTorch's own low-precision
error of the float64 oracle) to each case. A launch that runs past its deadline is killed and
fails the test; every worker destroys its process groups.

CPU matrix (fp16, tiny shapes; about 30 s on 2 cores): 2 and 4 ranks x {zigzag, contiguous} x
{causal, full} with MHA, GQA and MQA spread over them, plus a causal window crossing chunk
boundaries with softcap, a two-sided window, ``d_v != d``, batch 2, and rings on sub-groups (size 1,
and two rings of 2 inside 4 ranks). In-process: world size 1 (no process group) is bitwise
``flash_attn_func``, host validation, and the planner's exactness on dense masks (many world
sizes, layouts and windows, no kernels). GPU (``-m gpu``, 2 GPUs, NCCL): bf16 {zigzag, contiguous}
x {causal, full, causal window 300} at b2 S2048 Hq8 Hkv2 d128, fp16 zigzag causal, and MQA d64
softcap at S4096.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from oracle import ON_GPU, assert_close, assert_lse_close

from solattn import flash_attn_func
from solattn.reference import allowed_mask, attention_ref

REPO = Path(__file__).resolve().parents[1]
# Per launch; a GPU launch also JIT-compiles the kernels of every case (Triton, Gluon).
SPAWN_TIMEOUT_S = {"cpu": 300, "cuda": 900}
GRADS = ("dq", "dk", "dv")


def case(layout, causal, h, h_kv, seqlen, *, b=1, d=16, dv=None, window=(-1, -1), softcap=0.0,
         group="world", dtype="float16"):
    return dict(layout=layout, causal=causal, h=h, h_kv=h_kv, seqlen=seqlen, b=b, d=d,
                dv=dv or d, window=list(window), softcap=softcap, group=group, dtype=dtype)


# world size -> {name: case}. seqlen is the whole sequence (divisible by 2 * world).
CPU_CASES = {
    2: {
        "zigzag-causal-gqa": case("zigzag", True, 4, 2, 36),
        "zigzag-full-mqa": case("zigzag", False, 2, 1, 36, d=24, dv=16),
        "contiguous-causal-mha": case("contiguous", True, 2, 2, 36, b=2),
        "contiguous-full-gqa": case("contiguous", False, 4, 2, 36),
        "zigzag-causal-window-softcap": case("zigzag", True, 2, 1, 36, window=(11, -1),
                                             softcap=4.0),
        "contiguous-window-2sided": case("contiguous", False, 2, 2, 36, window=(5, 3)),
        "zigzag-causal-selfgroup": case("zigzag", True, 2, 1, 36, group="single"),
    },
    4: {
        "zigzag-causal-gqa": case("zigzag", True, 4, 2, 40),
        "zigzag-full-gqa": case("zigzag", False, 4, 2, 40),
        "contiguous-causal-mqa": case("contiguous", True, 2, 1, 40),
        "contiguous-full-mha": case("contiguous", False, 2, 2, 40),
        "zigzag-causal-window": case("zigzag", True, 2, 1, 40, window=(7, -1)),
        "zigzag-causal-pairs": case("zigzag", True, 2, 1, 40, group="pairs"),
    },
}

GPU_CASES = {
    2: {
        **{f"{layout}-{mask}-bf16": case(layout, mask != "full", 8, 2, 2048, b=2, d=128,
                                         dtype="bfloat16",
                                         window=(300, -1) if mask == "causal-window" else (-1, -1))
           for layout in ("zigzag", "contiguous") for mask in ("causal", "full", "causal-window")},
        "zigzag-causal-fp16": case("zigzag", True, 8, 2, 2048, b=2, d=128),
        "zigzag-causal-d64-mqa-softcap-bf16": case("zigzag", True, 8, 1, 4096, d=64,
                                                   softcap=20.0, dtype="bfloat16"),
    },
}


# -------------------------------------------------------------------------------------------
# Worker (one process per rank)
# -------------------------------------------------------------------------------------------

def _inputs(name: str, c: dict, device):
    """The whole problem, identical on every rank (seeded by the case name)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dtype = getattr(torch, c["dtype"])
    b, s, h, h_kv, d, dv = c["b"], c["seqlen"], c["h"], c["h_kv"], c["d"], c["dv"]
    shapes = dict(q=(b, s, h, d), k=(b, s, h_kv, d), v=(b, s, h_kv, dv), dout=(b, s, h, dv))
    x = {n: torch.randn(*shape, generator=g).to(device, dtype) for n, shape in shapes.items()}
    x["dlse"] = torch.randn(b, h, s, generator=g).to(device)
    return x


def _ring_group(kind: str, rank: int, world: int):
    """The case's ring: the world, each rank alone, or consecutive pairs. Collective."""
    import torch.distributed as dist

    if kind == "world":
        return None
    size = 1 if kind == "single" else 2
    group, _ = dist.new_subgroups(group_size=size)
    return group


def _run_case(name: str, c: dict, device, out_dir: Path):
    import torch.distributed as dist

    from solattn.distributed import ring_attention, ring_profile, shard_sequence, unshard_sequence

    rank, world = dist.get_rank(), dist.get_world_size()
    group = _ring_group(c["group"], rank, world)
    x = _inputs(name, c, device)
    kw = dict(group=group, layout=c["layout"])
    local = {n: shard_sequence(x[n], dim=2 if n == "dlse" else 1, **kw) for n in x}
    q, k, v = (local[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    with ring_profile() as prof:
        out, lse = ring_attention(q, k, v, causal=c["causal"], window_size=tuple(c["window"]),
                                  softcap=c["softcap"], return_lse=True, **kw)
        loss = (out.float() * local["dout"].float()).sum() + (lse * local["dlse"]).sum()
        loss.backward()
    steps = prof.steps()
    res = dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
    gathered = {n: unshard_sequence(t, dim=2 if n == "lse" else 1, **kw) for n, t in res.items()}
    roundtrip = torch.equal(unshard_sequence(local["q"], dim=1, **kw), x["q"])
    if dist.get_rank(group) == 0:
        torch.save(dict(inputs={n: t.cpu() for n, t in x.items()},
                        result={n: t.cpu() for n, t in gathered.items()},
                        roundtrip=roundtrip, steps=steps),
                   out_dir / f"{name}.rank{rank}.pt")
    if group is not None:
        dist.barrier()
        dist.destroy_process_group(group)


def _worker_main(argv):
    p = argparse.ArgumentParser()
    for arg in ("--rank", "--world"):
        p.add_argument(arg, type=int, required=True)
    for arg in ("--store", "--out", "--device", "--cases"):
        p.add_argument(arg, required=True)
    a = p.parse_args(argv)
    import datetime

    import torch.distributed as dist

    cases = json.loads(a.cases)
    if a.device == "cuda":
        torch.cuda.set_device(a.rank)
        device, backend = torch.device("cuda", a.rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{a.store}", rank=a.rank,
                            world_size=a.world, timeout=datetime.timedelta(seconds=120))
    try:
        for name, c in cases.items():
            _run_case(name, c, device, Path(a.out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------------
# Launcher
# -------------------------------------------------------------------------------------------

def launch(world: int, cases: dict, out_dir: Path, device: str) -> dict:
    """Run ``cases`` on ``world`` ranks; returns ``{(name, rank): saved dict}``. Kills every rank
    and fails once one rank fails or the launch passes :data:`SPAWN_TIMEOUT_S`."""
    timeout_s = SPAWN_TIMEOUT_S[device]
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "store"
    store.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # before the children import triton
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, logs = [], []
    for r in range(world):
        log = open(out_dir / f"rank{r}.log", "w")
        cmd = [sys.executable, __file__, "--worker", "--rank", str(r), "--world", str(world),
               "--store", str(store), "--out", str(out_dir), "--device", device,
               "--cases", json.dumps(cases)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=REPO))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        while any(pr.poll() is None for pr in procs):
            bad = [r for r, pr in enumerate(procs) if pr.poll() not in (None, 0)]
            if bad and failed is None:  # the others would wait for it: give them 10 s
                failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
                deadline = min(deadline, time.monotonic() + 10)
            if time.monotonic() > deadline:
                failed = failed or f"timeout after {timeout_s} s"
                break
            time.sleep(0.2)
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
        for log in logs:
            log.close()
    bad = [r for r, pr in enumerate(procs) if pr.returncode != 0]
    if failed or bad:
        tails = "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:]
                          for r in range(world))
        pytest.fail(f"ring launch on {world} ranks: {failed or f'ranks {bad} failed'}\n{tails}")
    results = {}
    for path in out_dir.glob("*.rank*.pt"):
        name, rank = path.name[: -len(".pt")].rsplit(".rank", 1)
        results[name, int(rank)] = torch.load(path, weights_only=False)
    return results


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """``runs(world, cases, device)`` launches once per (world, device) and caches."""
    cache = {}

    def runs(world, cases, device):
        if (world, device) not in cache:
            out = tmp_path_factory.mktemp(f"ring{world}{device}")
            cache[world, device] = launch(world, cases, out, device)
        return cache[world, device]

    return runs


# -------------------------------------------------------------------------------------------
# Checks
# -------------------------------------------------------------------------------------------

def _oracle(x: dict, c: dict, upcast: bool):
    """(out, lse, dq, dk, dv) of the oracle's autograd on the whole sequence."""
    dt = torch.float64 if upcast else None
    q, k, v = (x[n].detach().to(dt or x[n].dtype).requires_grad_() for n in ("q", "k", "v"))
    out, lse = attention_ref(q, k, v, causal=c["causal"], window_size=tuple(c["window"]),
                             softcap=c["softcap"], upcast=upcast)
    loss = (out * x["dout"].to(out.dtype)).sum() + (lse * x["dlse"].to(lse.dtype)).sum()
    return (out, lse, *torch.autograd.grad(loss, (q, k, v)))


def check_case(saved: dict, c: dict, device) -> None:
    x = {n: t.to(device) for n, t in saved["inputs"].items()}
    res = {n: t.to(device) for n, t in saved["result"].items()}
    assert saved["roundtrip"], "unshard_sequence(shard_sequence(x)) != x"
    hi, lo = _oracle(x, c, upcast=True), _oracle(x, c, upcast=False)
    for i, name in enumerate(("out", "lse", *GRADS)):
        assert res[name].dtype == (torch.float32 if name == "lse" else x["q"].dtype), name
        if name == "lse":
            assert_lse_close(res["lse"], hi[1].float())
        else:
            assert_close(f"ring {name}", res[name], hi[i], lo[i])
    phases = [row["phase"] for row in saved["steps"]]
    assert "fwd" in phases and "bwd" in phases
    assert all(row.get("compute_ms", 0.0) >= 0 and row.get("wait_ms", 0.0) >= 0
               for row in saved["steps"])


def _params(cases: dict):
    return [pytest.param(world, name, id=f"w{world}-{name}")
            for world, named in cases.items() for name in named]


@pytest.mark.skipif(ON_GPU, reason="the CPU (gloo) matrix; GPUs run the -m gpu variant")
@pytest.mark.parametrize("world,name", _params(CPU_CASES))
def test_ring_cpu(ring_runs, world, name):
    c = CPU_CASES[world][name]
    results = ring_runs(world, CPU_CASES[world], "cpu")
    leaders = [r for (n, r) in results if n == name]
    assert leaders, f"no result for {name}"
    for r in leaders:  # one per ring (several with sub-group rings)
        check_case(results[name, r], c, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("world,name", _params(GPU_CASES))
def test_ring_gpu(ring_runs, world, name):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    results = ring_runs(world, GPU_CASES[world], "cuda")
    check_case(results[name, 0], GPU_CASES[world][name], "cuda")


# -------------------------------------------------------------------------------------------
# In-process: world size 1, validation, the planner
# -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 2), softcap=3.0),
                                dict(causal=True, window_size=(5, -1))],
                         ids=["causal", "window-softcap", "causal-window"])
def test_world_size_1_is_flash_attn_func(layout, kw):
    from solattn.distributed import ring_attention

    dev = "cuda" if ON_GPU else "cpu"
    q = torch.randn(2, 12, 4, 16, dtype=torch.float16, device=dev, requires_grad=True)
    k = torch.randn(2, 12, 2, 16, dtype=torch.float16, device=dev, requires_grad=True)
    v = torch.randn(2, 12, 2, 24, dtype=torch.float16, device=dev, requires_grad=True)
    # deterministic: bitwise comparisons of two backward runs (no float atomics in dQ)
    out, lse = ring_attention(q, k, v, layout=layout, return_lse=True, deterministic=True, **kw)
    ref, ref_lse = flash_attn_func(q, k, v, return_lse=True, deterministic=True, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    g = torch.autograd.grad((out.float() * dout).sum() + (lse * dlse).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref.float() * dout).sum() + (ref_lse * dlse).sum(), (q, k, v))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    for name, a, b in zip(GRADS, g, g_ref):
        assert torch.equal(a, b), name


def _qkv(s=12, dtype=torch.float16):
    dev = "cuda" if ON_GPU else "cpu"
    return (torch.randn(1, s, 2, 16, dtype=dtype, device=dev),) * 3


@pytest.mark.parametrize("call,exc,match", [
    (lambda f: f(*_qkv(s=7)), ValueError, r"q: expected the local sequence length .* by 2"),
    (lambda f: f(*_qkv(), layout="ring"), ValueError, r"layout: expected one of"),
    (lambda f: f(_qkv()[0], *_qkv(s=10)[1:]), ValueError, r"k: expected seqlen_local"),
    (lambda f: f(*_qkv(dtype=torch.float32)), TypeError, r"q: expected dtype"),
    (lambda f: f(*_qkv(), window_size=(-2, 0)), ValueError, r"window_size"),
    (lambda f: f(*_qkv(), return_lse=1), TypeError, r"return_lse"),
], ids=["odd-local-zigzag", "layout", "seqlen-k", "fp32", "window", "return_lse"])
def test_validation(call, exc, match):
    from solattn.distributed import ring_attention

    with pytest.raises(exc, match=match):
        call(ring_attention)


def test_shard_sequence_validation():
    from solattn.distributed import shard_sequence, unshard_sequence

    x = torch.randn(1, 7, 2)
    with pytest.raises(ValueError, match=r"x: expected the sequence length .* divisible by 2"):
        shard_sequence(x, layout="zigzag")
    with pytest.raises(ValueError, match=r"dim: expected"):
        shard_sequence(x, dim=3)
    assert torch.equal(shard_sequence(x, layout="contiguous"), x)
    y = torch.randn(1, 8, 2)
    assert torch.equal(unshard_sequence(shard_sequence(y)), y)


def _global_index(layout, rank, world, n):
    from solattn.distributed.layout import local_segments

    idx = torch.empty(n, dtype=torch.long)
    for s in local_segments(layout, rank, world, n):
        idx[s.local:s.local + s.length] = torch.arange(s.start, s.start + s.length)
    return idx


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_plan_covers_the_mask_exactly(layout, world):
    """Every (query, key) cell the global mask allows is computed exactly once over all ranks
    and steps, no other cell is, and every piece's rows and columns each see something."""
    from solattn.distributed.plan import make_plan

    n = 10
    windows = [(-1, -1), (0, 0), (2, -1), (-1, 3), (4, 1), (7, -1), (13, 2), (0, -1), (30, 30)]
    for causal in (False, True):
        for window in windows:
            want = allowed_mask(world * n, world * n, causal, window)
            cover = torch.zeros(want.shape, dtype=torch.int32)
            steps = {make_plan(layout, r, world, n, causal, window).num_steps
                     for r in range(world)}
            assert len(steps) == 1, "ranks disagree on the number of steps"
            for r in range(world):
                plan = make_plan(layout, r, world, n, causal, window)
                qi = _global_index(layout, r, world, n)
                for s, pieces in enumerate(plan.steps):
                    ki = _global_index(layout, plan.source(s), world, n)
                    for pc in pieces:
                        m = allowed_mask(pc.q_hi - pc.q_lo, pc.k_hi - pc.k_lo, pc.causal,
                                         pc.window)
                        assert m.any(1).all() and m.any(0).all(), f"untrimmed {pc}"
                        rows = qi[pc.q][:, None].expand_as(m)[m]
                        cols = ki[pc.k][None, :].expand_as(m)[m]
                        cover.index_put_((rows, cols), torch.ones_like(rows, dtype=torch.int32),
                                         accumulate=True)
            assert cover.max() <= 1, f"a cell computed twice ({causal=}, {window=})"
            assert torch.equal(cover.bool(), want), f"mask differs ({causal=}, {window=})"


def test_plan_zigzag_causal_is_one_call_per_step():
    """The classic zigzag schedule: balanced, one unmasked half-size call off the diagonal."""
    from solattn.distributed.plan import make_plan

    for r in range(4):
        plan = make_plan("zigzag", r, 4, 8, True, (-1, -1))
        assert plan.num_steps == 4 and all(len(p) == 1 for p in plan.steps)
        (diag,) = plan.steps[0]
        assert diag.causal and (diag.q_lo, diag.q_hi, diag.k_lo, diag.k_hi) == (0, 8, 0, 8)
        for s in range(1, 4):
            (pc,) = plan.steps[s]
            assert not pc.masked and (pc.q_hi - pc.q_lo) * (pc.k_hi - pc.k_lo) == 32
    # a window shorter than a chunk: K/V travel one hop only
    assert make_plan("contiguous", 1, 4, 16, True, (5, -1)).num_steps == 2


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.argv.remove("--worker")
    _worker_main(sys.argv[1:])
