"""The AOT gate: its SASS reading (synthetic cuobjdump text), its result cache (one tiny kernel
compiled with Triton's compiler, no GPU), the per-architecture checks and subsets, and the
specs read off replayed launcher calls (:mod:`solattn.aot_calls`)."""
import dataclasses
import functools
import inspect
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
import triton.language as tl

from solattn.device import interpreting
from solattn.kernels.sass import hot_local_accesses


def _replayed(test):
    """A test that replays launchers (:mod:`solattn.aot_calls`). Triton's interpreter
    (TRITON_INTERPRET=1, which the suite sets on a CPU machine) makes every ``@triton.jit`` an
    interpreted function, which compiles nothing and calls no ``jit_cache_hook``: under it the
    test runs in a child Python without the interpreter (plain Python: the suite's conftest
    asks for the interpreter on a machine without CUDA)."""

    @functools.wraps(test)
    def wrapper(**fixtures):
        if not interpreting():
            return test(**fixtures)
        root = str(pathlib.Path(__file__).resolve().parents[1])
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import test_aot; test_aot._direct({test.__name__!r})"
        child = subprocess.run([sys.executable, "-c", code], cwd=here, env=env,
                               capture_output=True, text=True, timeout=900)
        assert child.returncode == 0, (child.stdout + child.stderr)[-4000:]

    return wrapper


def _direct(name: str) -> None:
    """Run test ``name`` here, with the fixtures it takes (tmp_path, monkeypatch)."""
    test = globals()[name].__wrapped__
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        given = {"tmp_path": pathlib.Path(tmp), "monkeypatch": mp}
        test(**{p: given[p] for p in inspect.signature(test).parameters})


def _sass(*lines):
    return "\n".join(f"        /*{addr:04x}*/                   {text} ;" for addr, text in lines)


def test_spill_outside_loops_is_cold():
    sass = _sass((0x10, "STL [R1], R2"), (0x20, "HGMMA.64x32x16.F32.BF16 R152, gdesc[UR16]"),
                 (0x30, "@!P5 BRA 0x20"), (0x40, "LDL R194, [R1]"), (0x50, "EXIT"))
    assert hot_local_accesses(sass) == 0


def test_spill_in_innermost_loop_is_hot():
    sass = _sass((0x10, "STL [R1], R2"), (0x20, "LDL R3, [R1]"), (0x30, "@P0 BRA 0x20"),
                 (0x40, "EXIT"))
    assert hot_local_accesses(sass) == 1


def test_only_innermost_loops_count():
    # outer loop 0x10..0x80 holds an inner loop 0x30..0x50 and a reload between the two
    sass = _sass((0x10, "IADD3 R0, R0, 0x1, RZ"), (0x20, "LDL R5, [R1+0x4]"),
                 (0x30, "STL [R1+0x8], R6"), (0x40, "LDL R6, [R1+0x8]"),
                 (0x50, "@!P2 BRA `(.L_x_3) 0x30"), (0x60, "LDL R7, [R1]"),
                 (0x80, "@P4 BRA 0x10"), (0x90, "EXIT"))
    assert hot_local_accesses(sass) == 2


def test_forward_branches_are_not_loops():
    sass = _sass((0x10, "@P0 BRA 0x40"), (0x20, "LDL R1, [R1]"), (0x40, "EXIT"))
    assert hot_local_accesses(sass) == 0


def test_accepted_spill_is_reported_not_failed():
    """A spill listed as measured and accepted by its config passes, with the reason in the
    line; the same spill without the listing fails (Gluon: any spill)."""
    from solattn.aot import AotResult, AotSpec

    def result(accepted):
        spec = AotSpec(name="fwd_hopper", config="d256", fn=None, signature={}, constexprs={},
                       gluon=True, accepted_spill=accepted)
        return AotResult(spec, 90, True, registers=168, spill_bytes=32, hot_spills=1,
                         sass_ops={"HGMMA": 1, "LDL/STL": 3})

    assert result("").failed and result("").line().startswith("SPILL")
    kept = result("measured: spill-free config 0.69x")
    assert not kept.failed
    assert kept.line().startswith("kept") and "spill accepted: measured" in kept.line()


@_replayed
def test_flex_hopper_specs():
    """`solattn aot --arch 90` compiles the Hopper flex forward for each mod it lists at head
    dims 64 and 128, with the mods' Gluon twins, as the plan ``prepare`` builds launches it
    (the compile and spill gate itself is `solattn aot`, which CI runs)."""
    from solattn import aot_calls
    from solattn.kernels.hopper.flex_forward_plan import AOT_VARIANTS

    specs = aot_calls.specs(90, aot_calls.fwd_flex_hopper_calls(90))
    assert aot_calls.fwd_flex_hopper_calls(80) == []
    assert len(specs) == 2 * len(AOT_VARIANTS)
    assert all(s.gluon and s.constexprs["SPARSE_N"] == 128 for s in specs)
    assert {s.constexprs["HEAD_DIM"] for s in specs} == {64, 128}
    alibi = next(s for s in specs if "alibi" in s.config)
    assert alibi.constexprs["SCORE_MOD"].__name__.endswith("_gl")
    assert alibi.constexprs["MASK_MOD"].__name__.endswith("_gl")
    # the launch's own types: bf16 TMA descriptors, the block lists as a tuple argument
    assert alibi.signature["q_desc"].startswith("tensordesc<bf16[1, 1, 64,")
    assert alibi.signature["KV_LIST"][:2] == ("*i32", "*i32")


@_replayed
def test_every_declared_variant_is_compiled():
    """Each flag set a kernel module declares (AOT_VARIANTS and its kin) is a spec on sm_90 and
    sm_80, at each head dim its family compiles; no two specs are the same binary."""
    from solattn import aot, aot_cache, aot_calls
    from solattn.configs import all_bwd_configs, all_fwd_configs

    fwd, bwd, dec = aot_calls.mod("fwd"), aot_calls.mod("bwd"), aot_calls.mod("decode")
    hf, hb = aot_calls.mod("hopper_fwd"), aot_calls.mod("hopper_bwd")
    hff, hfb = aot_calls.mod("hopper_flex_fwd"), aot_calls.mod("hopper_flex_bwd")
    for arch in (90, 80):
        specs = aot.collect_specs(arch)
        have = {(s.name, s.variant, s.head_dim) for s in specs}
        keys = [aot_cache.spec_key(s, arch) for s in specs]
        assert len(set(keys)) == len(keys)
        for d, upper in all_fwd_configs(arch):
            for vname in fwd.AOT_VARIANTS:
                assert ("fwd_portable", f"{'causal ' if upper else ''}{vname}", d) in have
        for d, scores in all_bwd_configs(arch):
            if scores or d <= 32:
                assert ("bwd_dkdv", "all-features" if scores else "masks", d) in have
        for d in (64, 128):
            for vname in dec.AOT_VARIANTS:
                assert ("decode_splitkv", vname, d) in have
            for vname in fwd.AOT_FLEX_VARIANTS:
                assert ("fwd_flex", vname, d) in have
            for vname in bwd.AOT_FLEX_VARIANTS:
                assert {("bwd_flex_dkdv", vname, d), ("bwd_flex_dq", vname, d)} <= have
        if arch != 90:
            assert not any(s.gluon for s in specs)
            continue
        for d in hf.SUPPORTED_HEAD_DIMS:
            for vname in hf.AOT_VARIANTS:
                # ("short-causal": the config of "dynamic-causal" at d=64 and of "causal" at
                # d=256; "mid-causal" and "few-causal": of "causal" and "causal-lpt" at both;
                # one binary each)
                assert any(n == "fwd_hopper" and d == hd and vname == v for n, v, hd in have) or \
                    (vname, d) in (("short-causal", 64), ("short-causal", 256),
                                   ("mid-causal", 64), ("mid-causal", 256),
                                   ("few-causal", 64), ("few-causal", 256))
        for d in hb.SUPPORTED_HEAD_DIMS:
            for vname, f in hb.AOT_VARIANTS.items():
                if hb.variant_covered(d, f):
                    found = [s for s in specs if (s.name, s.variant, s.head_dim)
                             == ("bwd_hopper", vname, d)]
                    assert len(found) == 2  # dK/dV in bf16 (MHA) and split fp32 (GQA)
        for vname in hff.AOT_VARIANTS:
            assert {("fwd_flex_hopper", vname, 64), ("fwd_flex_hopper", vname, 128)} <= have
        for vname in hfb.AOT_VARIANTS:
            assert {("bwd_flex_hopper", vname, 64), ("bwd_flex_hopper", vname, 128)} <= have
        fp8 = {s.config.split()[-1] for s in specs if s.name == "fwd_hopper_fp8"}
        assert fp8 == set(hf.AOT_FP8_VARIANTS)


def _tiny_copy(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def _tiny_spec(block: int):
    """A real kernel small enough to compile in a second (a JITFunction built directly: under
    TRITON_INTERPRET=1, ``triton.jit`` would return the interpreter's wrapper), read off its
    launch as `solattn aot` reads every kernel's."""
    from triton.runtime.jit import JITFunction

    from solattn import aot_calls

    fn = JITFunction(_tiny_copy)
    x = torch.empty(1000, dtype=torch.float16)
    call = aot_calls.Call(lambda: fn[(1,)](x, x, 1000, BLOCK=block, num_warps=4),
                          {"_tiny_copy": "tiny_copy"}, label=f"b{block}")
    (spec,) = aot_calls.specs(80, [call])
    assert spec.signature["X"] == "*fp16" and spec.constexprs["BLOCK"] == block
    return dataclasses.replace(spec, tensor_cores=False)


@_replayed
def test_cache_skips_an_unchanged_spec(tmp_path, monkeypatch):
    """A spec compiled once is read back from $SOLATTN_CI_CACHE/aot without compiling (the spy
    counts compiles); another constexpr, architecture or Triton setting is a new key and
    compiles; SOLATTN_AOT_CACHE=0 compiles every time."""
    from solattn import aot

    monkeypatch.setenv("SOLATTN_CI_CACHE", str(tmp_path))
    monkeypatch.delenv("SOLATTN_AOT_CACHE", raising=False)
    # The compiler runs only with the interpreter off (Triton 3.9 reads the setting per call).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = aot.compile_spec

    def spy(spec, arch):
        calls.append((spec.config, arch))
        return real(spec, arch)

    monkeypatch.setattr(aot, "compile_spec", spy)
    spec = _tiny_spec(128)
    (first,), stats = aot.compile_all([(80, spec)], procs=1)
    assert calls == [("b128", 80)] and stats.compiled == 1 and stats.cached == 0
    assert first.ok and not first.cached and first.registers > 0 and not first.failed
    assert len(list((tmp_path / "aot").glob("*.json"))) == 1

    (again,), stats = aot.compile_all([(80, _tiny_spec(128))], procs=1)
    assert calls == [("b128", 80)] and stats.cached == 1 and stats.compiled == 0
    assert again.cached
    assert (again.registers, again.shared, again.sass_ops) == (
        first.registers, first.shared, first.sass_ops)

    aot.compile_all([(80, _tiny_spec(256)), (86, spec)], procs=1)
    assert calls[1:] == [("b256", 80), ("b128", 86)]

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # a compile setting: a new key
    aot.compile_all([(80, spec)], procs=1)
    assert calls[3:] == [("b128", 80)]
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")

    monkeypatch.setenv("SOLATTN_AOT_CACHE", "0")
    aot.compile_all([(80, spec)], procs=1)
    assert calls[4:] == [("b128", 80)]


def _result(arch, shared=0, sass=None, tensor_cores=True):
    from solattn.aot import AotResult, AotSpec

    spec = AotSpec(name="fwd_portable", config="d128", fn=None, signature={}, constexprs={},
                   tensor_cores=tensor_cores)
    return AotResult(spec, arch, True, registers=200, shared=shared, sass_ops=sass or {})


def test_shared_memory_limit_per_arch():
    """70 KB fits every part; 120 KB fits sm_80 (163 KB) and sm_90 but not the 99 KB parts."""
    hmma = {"HMMA": 8, "HGMMA": 8}
    assert not _result(86, 70 * 1024, hmma).failed
    for arch in (80, 90):
        assert not _result(arch, 120 * 1024, hmma).failed
    for arch in (86, 89, 120):
        bad = _result(arch, 120 * 1024, hmma)
        assert bad.failed and "shared memory" in bad.line() and bad.line().startswith("FAIL")


def test_tensor_core_ops_per_arch():
    """sm_100's tcgen05 ops (UTCHMMA, UTCQMMA) count as tensor-core use there and nowhere else;
    a kernel without a tl.dot is not asked for any."""
    assert not _result(100, sass={"UTCHMMA": 4}).failed
    assert not _result(100, sass={"UTCQMMA": 2}).failed
    assert _result(80, sass={"UTCHMMA": 4}).failed
    assert not _result(80, sass={"HMMA": 4}).failed
    assert not _result(90, sass={"HGMMA": 4}).failed
    gluon = _result(90, sass={"HMMA": 4})
    gluon.spec = dataclasses.replace(gluon.spec, gluon=True)
    assert gluon.failed and "HGMMA/QGMMA" in gluon.line()  # a Gluon kernel needs wgmma
    none = _result(120, sass={"HMMA": 0, "LDGSTS": 3})
    assert none.failed and "no tensor-core instruction" in none.line()
    assert not _result(120, sass={}, tensor_cores=False).failed


@_replayed
def test_representative_subset():
    """sm_80 and sm_90 compile every spec; the seeds' other architectures the forward, backward,
    decode and combine kernels at head-dim tiles 64, 128 and 256 in their REPRESENTATIVE
    variants."""
    from solattn.aot import REPRESENTATIVE, collect_specs

    full = collect_specs(80)
    for arch in (86, 100):
        subset = collect_specs(arch)
        assert {s.name for s in subset} == set(REPRESENTATIVE)
        assert all(s.variant in REPRESENTATIVE[s.name] for s in subset)
        fwd = {s.head_dim for s in subset if s.name == "fwd_portable"}
        assert fwd == {64, 128, 256}
        assert len(subset) < len(full) // 4


def test_cache_prunes_entries_unread_for_two_weeks(tmp_path):
    """Old source versions' entries go; an entry read recently (its mtime touched) stays."""
    import os
    import time

    from solattn.aot import AotResult
    from solattn.aot_cache import CACHE_DAYS, ResultCache

    old, fresh = tmp_path / "old.json", tmp_path / "fresh.json"
    old.write_text("{}")
    fresh.write_text("{}")
    stale = time.time() - (CACHE_DAYS + 1) * 86400
    os.utime(old, (stale, stale))
    ResultCache(str(tmp_path), AotResult.CACHED).prune()
    assert not old.exists() and fresh.exists()


@_replayed
def test_cache_key_reads_only_the_kernels_own_sources(monkeypatch):
    """A spec's key hashes the files its kernel imports, transitively: an edit to the Hopper
    backward changes the keys of the Hopper backward and of the Hopper flex backward (which
    imports it) and of no portable kernel; an edit to kernels/common.py changes the key of
    every kernel but the combine (which does not import it); a generated flex mod adds
    flex/device.py, which its code calls."""
    from solattn import aot, aot_cache

    specs = [s for arch in (80, 90) for s in aot.collect_specs(arch)]
    by_name = {}
    for spec in specs:
        by_name.setdefault(spec.name, spec)
    files = {name: {rel for rel, _ in aot_cache.spec_sources(s)} for name, s in by_name.items()}
    assert ({"kernels/triton/forward.py", "masking.py", "configs/portable.py"}
            <= files["fwd_portable"])
    assert "kernels/hopper/backward.py" not in files["fwd_portable"]
    assert "kernels/triton/forward.py" not in files["bwd_dkdv"]
    assert {"kernels/hopper/backward.py", "kernels/hopper/compat.py"} <= files["bwd_hopper"]
    assert "kernels/triton/backward.py" not in files["bwd_hopper"]
    flex = next(s for s in specs if s.name == "fwd_flex" and s.constexprs.get("SCORE_MOD"))
    assert "flex/device.py" in {rel for rel, _ in aot_cache.spec_sources(flex)}
    assert all("core.py" not in f and "dispatch.py" not in f for f in files.values())

    def keys():
        return {name: aot_cache.spec_key(s, 90 if "hopper" in name else 80)
                for name, s in by_name.items()}

    before = keys()
    real = aot_cache.file_digest

    def edited(target):
        monkeypatch.setattr(aot_cache, "file_digest",
                            lambda rel: real(rel) + ("edit" if rel == target else ""))
        return {name for name, key in keys().items() if key != before[name]}

    assert edited("kernels/hopper/backward.py") == {
        "bwd_hopper", "bwd_hopper_preprocess", "bwd_hopper_reduce", "bwd_hopper_dq_convert",
        "bwd_flex_hopper"}
    assert edited("kernels/triton/combine.py") >= {"combine", "decode_splitkv"}
    assert "bwd_dkdv" not in edited("kernels/triton/combine.py")
    assert edited("kernels/common.py") == set(by_name) - {"combine"}  # all but combine use it
    monkeypatch.setattr(aot_cache, "file_digest", real)
    assert keys() == before
