"""``solattn warmup``: the kernels it compiles are the ones a call's JIT looks up, for any shape,
and a new process's first launch loads them from the cache.

No GPU: Triton compiles for sm_90 / sm_80 on the CPU. The checks that need Triton's compiler run
in a subprocess without the interpreter (under TRITON_INTERPRET=1 kernels are interpreted and
nothing compiles); the argument checks run here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from oracle import ON_GPU

from solattn.cli import main
from solattn.device import triton_version


def _python(code: str, cache_dir, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], env=env,
                          capture_output=True, text=True, timeout=600)


# Where JITFunction.run (a call) and JITFunction.preload (the warmup) meet: _do_compile. The
# stand-in records the key triton.compile would look the binary up under (get_cache_key, as
# compile computes it) and compiles nothing (run then launches nothing).
_RECORD = """
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.compiler.compiler import get_cache_key

def record(fn, seen):
    def _do_compile(key, signature, device, constexprs, options, attrs, warmup):
        _, _, target, backend, _ = fn.device_caches[device]
        src = fn.ASTSource(fn, signature, constexprs, attrs)
        opts = backend.parse_options(dict(options.__dict__, **src.parse_options()))
        seen.add((fn.__name__, str(target), get_cache_key(src, backend, opts,
                                                          get_cache_invalidating_env_vars())))
    fn._do_compile = _do_compile
"""

_KEYS = _RECORD + """
import torch
from solattn import warmup
from solattn.core import make_params
from solattn.dispatch import BACKWARD, FORWARD, default_route
from solattn.kernels.hopper import backward as hopper_backward
from solattn.kernels.hopper.backward_plan import attn_bwd as hopper_bwd
from solattn.kernels.hopper.forward_plan import attn_fwd as hopper_fwd
from solattn.kernels.hopper.forward import attn_fwd_kernel as hopper_kernel
from solattn.kernels.triton import backward, forward

kernels = [forward.attn_fwd_kernel, hopper_kernel, backward.attn_bwd_preprocess_kernel,
           backward.attn_bwd_dkdv_kernel, backward.attn_bwd_dq_kernel,
           hopper_backward.bwd_preprocess_kernel, hopper_backward.attn_bwd_kernel,
           hopper_backward.bwd_dkdv_reduce_kernel, hopper_backward.bwd_dq_convert_kernel]
# (batch, seqlen_q, seqlen_k, heads, heads_kv): odd lengths, length 1, GQA, MQA; GQA grids of
# 4 CTAs (the CPU's 4 "SMs": the Hopper backward splits them when causal; 250 keys at d<=128's
# 128-key blocks, 120 at d=256's 64-key blocks); K + V of over 8 MiB a
# head (the causal Hopper forward's head-major order rather than longest first: lpt_all_heads);
# many tiles of short keys (a schedule of their own, not longest first: hopper_fwd_config);
# many tiles of 8192 keys whose K + V exceed 32 MiB (d=128 causal: claimed longest first in
# head groups); few tiles of 9000 keys (one CTA a tile, longest first over all heads)
shapes = [(1, 1024, 1024, 8, 8), (3, 17, 113, 6, 2), (2, 1, 4097, 4, 1), (1, 1000, 1000, 3, 3),
          (1, 77, 250, 4, 2), (1, 1, 40000, 2, 2), (1, 1, 40000, 2, 1), (9, 1024, 1024, 16, 16),
          (9, 1024, 1024, 16, 4), (1, 77, 120, 4, 2), (1, 2048, 8192, 9, 9),
          (1, 2048, 8192, 36, 9), (1, 1, 9000, 2, 2), (1, 1, 9000, 2, 1)]
for arch in (90, 80):
    cases = warmup.cases((64, 128, 256), ("fp16", "bf16"))
    jobs = warmup.collect_jobs(arch, cases)
    from_warmup, from_calls = set(), set()
    with warmup.targeting(arch):
        for fn in kernels:
            record(fn, from_warmup)
        for job in jobs:
            job.fn.preload(job.specialization)
        for fn in kernels:  # calls: the JIT's own run(), from the launchers the dispatcher calls
            fn.device_caches.clear()
            record(fn, from_calls)
        for case in cases:
            for b, sq, sk, h, hk in shapes:
                if case.gqa != (h != hk):
                    continue
                dtype, d = warmup.DTYPES[case.dtype], case.head_dim
                q = torch.randn(b, sq, h, d, dtype=dtype)
                k, v = (torch.randn(b, sk, hk, d, dtype=dtype) for _ in range(2))
                p = make_params(q, k, causal=case.causal)
                if default_route(FORWARD, arch, q, k, v, p)[0] == "hopper":
                    out, lse = hopper_fwd(q, k, v, p, return_lse=True)
                else:
                    out, lse = forward.attn_fwd(q, k, v, p, return_lse=True, arch=arch)
                if default_route(BACKWARD, arch, None, q, k, v, out, lse, p)[0] == "hopper":
                    hopper_bwd(torch.randn_like(out), q, k, v, out, lse, p)
                else:
                    backward.attn_bwd(torch.randn_like(out), q, k, v, out, lse, p, arch=arch)
    assert len(from_warmup) == len(jobs) > 10, (len(from_warmup), len(jobs))
    missing = from_calls - from_warmup
    assert not missing, f"sm_{arch}: calls compile kernels the warmup does not: {missing}"
    unused = from_warmup - from_calls
    assert not unused, f"sm_{arch}: the warmup compiles kernels no call uses: {unused}"
    for fn in kernels:
        del fn._do_compile  # the class's again
        fn.device_caches.clear()
    print(f"sm_{arch}: the {len(jobs)} kernels' keys are the calls' keys")
"""


def test_warmup_keys_are_the_jit_keys_of_calls(tmp_path):
    """The cache keys of the warmup's kernels equal those ``JITFunction.run`` computes for calls
    of several shapes (lengths 1, 17, 113, 1000, 1024, 4097; MHA, GQA, MQA) of every covered
    case: the warmup compiles exactly what calls look up (no compile here)."""
    res = _python(_KEYS, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "sm_90:" in res.stdout and "sm_80:" in res.stdout, res.stdout


_KV_KEYS = _RECORD + """
import torch
from solattn import warmup
from solattn.kernels.triton.decode import decode_kernel
from solattn.core import make_params
from solattn.kernels.triton.decode import decode_forward
from solattn.kvcache import _kvcache_impl

cases = [c for c in warmup.cases((64, 128), ("fp16", "bf16"), kvcache=True) if c.kvcache]
jobs = warmup.collect_jobs(90, cases)
# (batch, heads, heads_kv, capacity, cache_seqlens): odd capacities and lengths, GQA, MQA, MHA
shapes = [(1, 32, 8, 8192, [4095]), (3, 6, 2, 113, [100, 5, 0]), (1, 8, 1, 4097, [4000]),
          (2, 4, 4, 1000, [999, 17]), (2, 3, 3, 77, [3, 60]), (1, 2, 2, 4096, [4000])]
from_warmup, from_calls = set(), set()
with warmup.targeting(90):
    record(decode_kernel, from_warmup)
    for job in jobs:
        job.fn.preload(job.specialization)
    decode_kernel.device_caches.clear()
    record(decode_kernel, from_calls)
    for case in cases:  # CPU tensors: arch 90 and a 4-SM GPU's split counts
        for b, h, hk, cap, lens in shapes:
            if case.gqa != (h != hk):
                continue
            dtype, d = warmup.DTYPES[case.dtype], case.head_dim
            q = torch.randn(b, 1, h, d, dtype=dtype)
            kc, vc = (torch.randn(b, cap, hk, d, dtype=dtype) for _ in range(2))
            seqlens = torch.tensor(lens, dtype=torch.int32)
            for s_new in (0, 1):
                k, v = ((torch.randn(b, s_new, hk, d, dtype=dtype) for _ in range(2)) if s_new
                        else (None, None))
                for splits in (1, 0, 7):  # the validated call (the public one refuses CPU)
                    _kvcache_impl(q, kc, vc, k, v, None, None, seqlens, None, None, None, None,
                                  d ** -0.5, case.causal, -1, -1, 0.0, True, splits)
            # flash_attn_func's few-row forward (the whole cache, no cache_seqlens)
            decode_forward(q, kc, vc, make_params(q, kc, causal=case.causal), True)
assert len(from_warmup) == len(jobs) == 6 * len(cases), (len(from_warmup), len(jobs))
missing = from_calls - from_warmup
assert not missing, f"calls compile decode kernels the warmup does not: {missing}"
unused = from_warmup - from_calls
assert not unused, f"the warmup compiles decode kernels no call uses: {unused}"
print(f"the {len(jobs)} decode kernels' keys are the calls' keys")
"""


def test_warmup_kvcache_keys_are_the_jit_keys_of_calls(tmp_path):
    """``--kvcache``: the decode kernels the warmup compiles are those ``flash_attn_with_kvcache``
    looks up for decode steps of other shapes (batch 1-3, odd capacities, MHA/GQA/MQA, with and
    without an appended token, one split or several, causal or not) and flash_attn_func's
    few-row forward (decode.decode_forward, no cache_seqlens): no compile here."""
    res = _python(_KV_KEYS, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "decode kernels' keys are the calls' keys" in res.stdout, res.stdout


_FIRST_LAUNCH = """
import torch
from triton import knobs
from solattn import warmup
from solattn.core import make_params
from solattn.kernels.hopper.forward_plan import attn_fwd

class Loaded(Exception):
    pass

def stop(*, src, cache_hit, **_):  # after the cache lookup, before the launch
    raise Loaded(f"{src.name} cache_hit={cache_hit}")

knobs.compilation.listener = stop
q, k, v = (torch.randn(2, 300, 4, 64, dtype=torch.float16) for _ in range(3))
if PORTABLE_FIRST:  # another kernel launched before: hashed (as its compile does), then stopped
    from solattn.kernels.triton.forward import attn_fwd as portable_fwd

    class Stopped(Exception):
        pass

    def stop_before_compile(*args, fn, **kwargs):
        fn.jit_function.cache_key
        raise Stopped

    with warmup.targeting(90, hook=stop_before_compile):
        try:
            portable_fwd(q, k, v, make_params(q, k, window_size=(8, 8)), return_lse=True, arch=90)
        except Stopped:
            pass
with warmup.targeting(90):
    try:
        attn_fwd(q, k, v, make_params(q, k, causal=True), return_lse=True)
    except Loaded as exc:
        print(exc)
"""


def test_first_launch_after_warmup_loads_from_cache(tmp_path):
    """``solattn warmup`` compiles the Hopper forwards (fp16, d64, causal) for sm_90 into an
    empty cache; in a new process a launch of another shape finds it there (the JIT's own
    run -> compile path, on the stand-in driver for sm_90), also when another kernel was
    launched first (Triton's cache keys depend on the order kernels are hashed in:
    solattn.kernels.keys fixes that order)."""
    res = _python(None, tmp_path, "-m", "solattn.cli", "warmup", "--arch", "90", "--head-dims",
                  "64", "--dtypes", "fp16", "--only", "causal fwd", "--jobs", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    # four binaries: causal tiles claimed by persistent CTAs (short keys at d=64) or one CTA
    # per tile, each longest first over all heads (few tiles) or head by head
    assert "4 kernels" in res.stdout and "(4 compiled, 0 already cached, 0 failed)" in res.stdout
    for portable_first in (False, True):
        first = _python(f"PORTABLE_FIRST = {portable_first}\n" + _FIRST_LAUNCH, tmp_path)
        assert first.stdout.strip() == "attn_fwd_kernel cache_hit=True", (
            portable_first, first.stdout + first.stderr)


# The warmup on a machine with the CUDA driver library (stood in: launcher_support() says
# yes), Triton's per-kernel launcher replaced by a recorder.
_LAUNCHERS = """
import triton.backends.nvidia.driver as nvidia_driver
from solattn import warmup

built = []

class Recorder:
    def __init__(self, src, metadata):
        built.append(src.fn.__name__)

nvidia_driver.CudaLauncher = Recorder
warmup.launcher_support = lambda: ""
jobs = warmup.collect_jobs(80, warmup.cases((64,), ("fp16",), gqa=False))[:1]
assert warmup.compile_jobs(80, jobs, 1) == 0
print(len(jobs), len(built), warmup.per_kernel_launchers())
"""


def test_launchers_built_only_where_triton_has_them(tmp_path):
    """Where the CUDA driver library is installed, the warmup builds each kernel's C launcher
    only where Triton has one per kernel (3.6). Triton 3.9's launcher reads the active
    driver's utility module, which the stand-in driver has not: building it there failed
    every kernel of ``solattn warmup`` on a GPU machine (H200, 2026-11-30)."""
    res = _python(_LAUNCHERS, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    jobs, built, per_kernel = res.stdout.split()[-3:]
    assert jobs == "1" and built == ("1" if per_kernel == "True" else "0"), res.stdout
    if triton_version() in ((3, 6), (3, 9)):  # the two stacks CI runs
        assert per_kernel == str(triton_version() == (3, 6)), res.stdout


def test_list_names_the_kernels_of_each_arch(tmp_path):
    """``--list`` compiles nothing and names each kernel once: on sm_90 the Hopper forward and,
    where it is the default with this Triton, the Hopper backward (per mask: one binary for MHA
    and unsplit GQA, two when causal: key-block or longest-first grid; causal GQA also split
    over CTAs: a binary with fp32 partial dK/dV and their reduce kernel; one backward
    preprocess kernel; five causal forwards: claimed tiles with O staged, head by head (short
    keys), longest first in head groups (up to 8192 keys) or over all heads (few tiles), and
    one CTA per tile on longer keys, head by head or longest first over all heads; one full
    forward at d=128, persistent with O staged, and with Triton >= 3.9 a second with O stored
    from registers (few tiles); the dQ conversion kernel);
    elsewhere the portable kernels (MHA and GQA; two
    dK/dV passes at d128 on sm_80), one preprocess kernel."""
    from solattn.core import make_params
    from solattn.dispatch import BACKWARD, default_route

    q = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 64)
    route, _ = default_route(BACKWARD, 90, None, q, q, q, q, lse, make_params(q, q))
    hopper_bwd = route == "hopper"
    res = _python(None, tmp_path, "-m", "solattn.cli", "warmup", "--arch", "90,80", "--list",
                  "--head-dims", "128", "--dtypes", "bf16")
    assert res.returncode == 0, res.stdout + res.stderr
    sm90, sm80 = res.stdout.split("solattn warmup: sm_80")
    # Triton >= 3.9: a full forward of few tiles stores O from registers, a second binary
    # (configs.hopper_forward.few_tiles_config)
    few_tiles_build = triton_version() >= (3, 9)
    n90 = 13 + few_tiles_build if hopper_bwd else None
    for text, fwd, bwd, n in ((sm90, "hopper", "hopper" if hopper_bwd else "triton", n90),
                              (sm80, "triton", "triton", 17)):
        labels = [ln.strip() for ln in text.splitlines() if ln.startswith("  ")]
        assert len(set(labels)) == len(labels), text
        if n is not None:
            assert f"{n} kernels" in text.splitlines()[0] and len(labels) == n, text
        assert f"bf16 d128 full fwd: {fwd} attn_fwd_kernel" in labels
        assert f"bf16 d128 causal fwd: {fwd} attn_fwd_kernel" in labels
        if fwd == "hopper":
            assert (("bf16 d128 full fwd: hopper attn_fwd_kernel #2" in labels)
                    == few_tiles_build), labels
            assert "bf16 d128 full fwd: hopper attn_fwd_kernel #3" not in labels, labels
            assert "bf16 d128 causal fwd: hopper attn_fwd_kernel #4" in labels, labels
        assert sum("preprocess" in lb for lb in labels) == 1
        if bwd == "hopper":
            for mode in ("full", "causal"):
                assert f"bf16 d128 {mode} bwd: hopper attn_bwd_kernel" in labels, labels
            assert "bf16 d128 causal bwd: hopper attn_bwd_kernel #2" in labels, labels
            # causal GQA: the split build first (the tiny grid), its reduce, the unsplit one
            # is the MHA causal binary
            assert "bf16 d128 causal gqa bwd: hopper attn_bwd_kernel" in labels, labels
            assert "bf16 d128 causal gqa bwd: hopper bwd_dkdv_reduce_kernel" in labels, labels
            assert "bf16 d128 full bwd: hopper bwd_dq_convert_kernel" in labels, labels
        else:
            for mode in ("full", "causal", "full gqa", "causal gqa"):
                assert f"bf16 d128 {mode} bwd: triton attn_bwd_dkdv_kernel" in labels, labels
    assert "bf16 d128 causal gqa fwd: triton attn_fwd_kernel" in sm80
    assert not list(tmp_path.iterdir())  # nothing compiled


@pytest.mark.parametrize("args, message", [
    (["--head-dims", "0"], "expected head dims in [1, 256], got [0]"),
    (["--head-dims", "64,300"], "got [300]"),
    (["--head-dims", "a"], "expected comma-separated integers, got 'a'"),
    (["--dtypes", "fp32"], "expected comma-separated dtypes from ['bf16', 'fp16'], got 'fp32'"),
    (["--arch", "9"], "expected compute capabilities as integers >= 70"),
    (["--arch", "90", "--jobs", "0"], "--jobs: expected a positive integer, got 0"),
])
def test_bad_arguments_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["warmup", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(ON_GPU, reason="a GPU is visible: --arch has a default")
def test_arch_required_without_gpu(capsys):
    with pytest.raises(SystemExit):
        main(["warmup", "--list"])
    assert "--arch: no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="checks the interpreter's refusal")
def test_refused_under_the_interpreter(capsys):
    with pytest.raises(SystemExit):
        main(["warmup", "--arch", "90", "--list"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


_GPU_FIRST_CALL = """
import time, torch
from triton import knobs
import solattn
misses = []

def listener(*, src, cache_hit, **_):
    if not cache_hit:
        misses.append(src.name)

knobs.compilation.listener = listener
q, k, v = (torch.randn(1, 1000, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
torch.cuda.synchronize()
t0 = time.perf_counter()
solattn.flash_attn_func(q, k, v, causal=True).backward(torch.randn_like(q))
torch.cuda.synchronize()
print(f"first call {time.perf_counter() - t0:.3f}s, compiled: {misses}")
assert not misses
"""


_GPU_FIRST_DECODE = """
import time, torch
from triton import knobs
import solattn
misses = []

def listener(*, src, cache_hit, **_):
    if not cache_hit:
        misses.append(src.name)

knobs.compilation.listener = listener
kc, vc = (torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.tensor([2500, 77], dtype=torch.int32, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
solattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
torch.cuda.synchronize()
print(f"first decode step {time.perf_counter() - t0:.3f}s, compiled: {misses}")
assert not misses
"""


@pytest.mark.gpu
def test_gpu_first_decode_after_warmup_compiles_nothing(tmp_path):
    """On the GPU: after ``solattn warmup --kvcache`` (bf16, d128), a new process's first
    decode step (append + attention, GQA, causal) compiles nothing."""
    res = _python(None, tmp_path, "-m", "solattn.cli", "warmup", "--head-dims", "128",
                  "--dtypes", "bf16", "--kvcache", "--only", "kvcache")
    assert res.returncode == 0, res.stdout + res.stderr
    first = _python(_GPU_FIRST_DECODE, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr


@pytest.mark.gpu
def test_gpu_first_call_after_warmup_compiles_nothing(tmp_path):
    """On the GPU: after ``solattn warmup`` (bf16, d64, MHA), a new process's first causal
    forward + backward compiles nothing (kernels and C launchers come from the cache)."""
    res = _python(None, tmp_path, "-m", "solattn.cli", "warmup", "--head-dims", "64",
                  "--dtypes", "bf16", "--no-gqa")
    assert res.returncode == 0, res.stdout + res.stderr
    first = _python(_GPU_FIRST_CALL, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
