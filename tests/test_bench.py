"""`solattn bench` without a GPU: FLOP counting, tables, argument handling, the sweep's JSON and
plots, --compare, the progress display and the exit code of a failed verification.

The sweep runs end to end on the CPU here (Triton's interpreter, tiny shapes, a wall clock): the
plumbing the H100 run uses, not its numbers.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from oracle import ON_GPU

from solattn.bench import peers as peers_mod
from solattn.bench.core import Shape, attn_flops, shape_matches, visible_pairs
from solattn.bench.progress import Progress
from solattn.bench.results import RESULT_KEYS, SCHEMA, Results, compare, make_record, print_table
from solattn.cli import main

cpu_only = pytest.mark.skipif(ON_GPU, reason="the GPU path runs in scripts/gpu_check.sh")


def test_flops_convention():
    s = Shape(1, 8, 4096, 8192, 128)
    assert attn_flops(s) == 4 * 1 * 8 * 4096 * 8192 * 128
    assert attn_flops(Shape(1, 8, 4096, 8192, 128, causal=True)) == attn_flops(s) / 2
    assert attn_flops(s, backward=True) == 2.5 * attn_flops(s)
    assert attn_flops(s, direction="bwd") == 2.5 * attn_flops(s)
    assert attn_flops(s, direction="fwdbwd") == 3.5 * attn_flops(s)
    # d_v != d: two matmuls of different widths, 2*(d + d_v) per score
    assert attn_flops(Shape(1, 1, 10, 10, 192, d_v=128)) == 2 * 100 * (192 + 128)


@pytest.mark.parametrize("n_q,n_k", [(7, 7), (5, 9), (9, 5), (1, 6)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (2, 1)),
                                           (True, (3, 2)), (False, (-1, 0)), (False, (0, -1))])
def test_visible_pairs_count_the_oracle_mask(n_q, n_k, causal, window):
    from solattn.reference import allowed_mask

    want = int(allowed_mask(n_q, n_k, causal, window or (-1, -1)).sum())
    assert visible_pairs(n_q, n_k, causal, window) == want


def test_table_ratios():
    rows = [{"shape": "B1 H8 L4096 D128", "kind": "fwd", "solattn-hopper": 660.0,
             "solattn-portable": 500.0, "cudnn": 600.0, "fa2": None}]
    lines = []
    print_table(rows, ["solattn-hopper", "solattn-portable", "cudnn", "fa2"], sol=800.0,
                out=lines.append)
    assert lines[-1] == "| B1 H8 L4096 D128 fwd | 660 | 500 | 600 | - | 82% | 1.10x |"


def test_shape_filter():
    s = Shape(4, 16, 4096, 4096, 128, causal=True)
    assert shape_matches(s, None)
    assert shape_matches(s, "D128")
    assert shape_matches(s, "D64,D128 causal")
    assert not shape_matches(s, "D128 full")
    assert not shape_matches(s, "D12")  # whole tokens, not substrings
    assert shape_matches(Shape(1, 8, 4096, 8192, 128), "Lk8192 full")


@pytest.mark.parametrize("argv, message", [
    (["--peers", "cudnn,nope"], "--peers: unknown ['nope']"),
    (["--sections", "fwd,sideways"], "--sections"),
    (["--sweep", "--sections", "decode"], "--sections"),
    (["--ladder", "--sections", "fwd"], "does not apply to --ladder"),
    (["--seqlens", "512"], "--seqlens applies to --sweep only"),
    (["--sweep", "--hdims", "48"], "--hdims"),
    (["--sweep", "--max-minutes", "0"], "--max-minutes"),
    (["--to", "new.json"], "--to needs --compare"),
    (["--compare", "/nonexistent/old.json"], "--compare"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_exclusive_modes_and_int_lists():
    with pytest.raises(SystemExit) as e:
        main(["bench", "--ladder", "--sweep"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "--sweep", "--seqlens", "1k"])
    assert e.value.code == 2


@cpu_only
def test_cpu_run_verifies_in_the_interpreter(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "verification passed" in out and "Timings need a CUDA GPU" in out


def _sweep(tmp_path, *extra):
    out = tmp_path / "sweep"
    rc = main(["bench", "--sweep", "--out", str(out), "--peers", "solattn,cudnn", *extra])
    data = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else None
    return rc, out, data


@cpu_only
def test_sweep_writes_schema_and_plots(tmp_path, capsys):
    rc, out, data = _sweep(tmp_path, "--sections", "fwd,bwd", "--seqlens", "40,24")
    assert rc == 0
    assert data["schema"] == SCHEMA and data["mode"] == "sweep"
    assert {"device", "torch", "triton", "solattn", "date", "timer"} <= set(data["env"])
    assert data["args"]["sections"] == "fwd,bwd"
    # 2 seqlens x (full, causal) x (fwd, bwd) for solattn; cudnn is unavailable on a CPU
    assert len(data["results"]) == 8
    for r in data["results"]:
        assert set(RESULT_KEYS) <= set(r)
        assert {"b", "h", "s_q", "s_k", "d", "causal"} <= set(r)
        assert r["name"] == "solattn" and r["unit"] == "TFLOP/s"
        assert r["value"] > 0 and r["ms"] > 0 and r["note"] is None
    assert {(r["section"], r["s_q"], r["causal"]) for r in data["results"]} == {
        (d, n, c) for d in ("fwd", "bwd") for n in (24, 40) for c in (False, True)}
    checks = data["verify"]
    assert checks and all(c["ok"] for c in checks)
    assert {c["what"] for c in checks} == {"out", "dq", "dk", "dv"}
    text = capsys.readouterr().out
    assert "estimate: about" in text and "peer cudnn: not available" in text
    from solattn.bench.plots import matplotlib_available

    if matplotlib_available():
        assert sorted(os.listdir(out)) == ["bench.json", "bwd_d32.png", "fwd_d32.png"]
    else:
        assert "plots skipped: matplotlib is not installed" in text


def test_plots_from_results(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install matplotlib)")
    from solattn.bench.plots import write_plots

    recs = [make_record(direction, name, Shape(16384 // n, 2048 // d, n, n, d, causal),
                        ms=1.0, value=100.0 + n / 100)
            for direction in ("fwd", "fwdbwd") for d in (64, 128) for causal in (False, True)
            for n in (512, 4096, 32768) for name in ("solattn", "cudnn", "fa4")]
    recs.append(make_record("fwd", "flex", Shape(1, 16, 512, 512, 128), note="OOM"))
    data = {"env": {"device": "test GPU"}, "dtype": "bfloat16", "sol_tflops": 700.0,
            "results": recs}
    paths = write_plots(data, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == [
        "fwd_d128.png", "fwd_d64.png", "fwdbwd_d128.png", "fwdbwd_d64.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_package_does_not_import_matplotlib():
    code = ("import sys; import solattn.cli, solattn.bench.cli, solattn.bench.sweep, "
            "solattn.bench.plots, solattn.bench.ladder_run; "
            "sys.exit(int('matplotlib' in sys.modules))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=300).returncode == 0


@cpu_only
def test_sweep_budget_records_skips(tmp_path):
    rc, _, data = _sweep(tmp_path, "--sections", "fwd", "--no-verify", "--max-minutes", "1e-9")
    assert rc == 0
    assert data["results"] and all(r["value"] is None and "budget" in r["note"]
                                   for r in data["results"] if r["name"] == "solattn")


def _wrong(setup):
    def broken(shape, x):
        attn = setup(shape, x)
        return lambda q, k, v: attn(q, k, v) + 1.0

    return broken


@cpu_only
def test_failed_verification_exits_nonzero(tmp_path, monkeypatch, capsys):
    peer = peers_mod.PEERS["solattn"]
    monkeypatch.setitem(peers_mod.PEERS, "solattn",
                        peers_mod.Peer(peer.name, _wrong(peer.setup), peer.directions))
    rc, _, data = _sweep(tmp_path, "--sections", "fwd")
    assert rc == 1
    assert any(c["ok"] is False and c["name"] == "solattn" for c in data["verify"])
    assert "verification FAILED" in capsys.readouterr().err


@cpu_only
def test_failed_verification_exits_nonzero_default_mode(monkeypatch, capsys):
    peer = peers_mod.PEERS["solattn-portable"]
    monkeypatch.setitem(peers_mod.PEERS, "solattn-portable",
                        peers_mod.Peer(peer.name, _wrong(peer.setup), peer.directions))
    assert main(["bench", "--peers", "solattn-portable"]) == 1
    assert "verification FAILED" in capsys.readouterr().err


@cpu_only
def test_failed_ladder_step_exits_nonzero(monkeypatch, tmp_path):
    from solattn.bench import ladder

    broken = [ladder.Step(s.key, s.name, s.change, s.seeds, _wrong(s.setup), s.vs)
              if s.name == "pipelined" else s for s in ladder.STEPS]
    monkeypatch.setattr(ladder, "STEPS", broken)
    assert main(["bench", "--ladder", "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "ladder.json").read_text())
    bad = {c["name"] for c in data["verify"] if c["ok"] is False}
    assert bad == {"pipelined"}


def _results_file(path, values):
    res = Results("sweep", {"device": "x"}, str(path))
    for (name, shape), v in values.items():
        res.add(make_record("fwd", name, shape, ms=1.0, value=v))
    return str(path)


def test_compare(tmp_path, capsys):
    a, b = Shape(1, 8, 4096, 4096, 128), Shape(1, 8, 4096, 4096, 128, causal=True)
    old = _results_file(tmp_path / "old.json", {("solattn", a): 500.0, ("solattn", b): 400.0,
                                                ("cudnn", a): 600.0})
    new = _results_file(tmp_path / "new.json", {("solattn", a): 550.0, ("solattn", b): 440.0,
                                                ("cudnn", a): None, ("fa4", a): 700.0})
    rows = compare(json.load(open(old)), json.load(open(new)))
    assert [(r["name"], round(r["ratio"], 3)) for r in rows] == [("solattn", 1.1),
                                                                  ("solattn", 1.1)]
    assert main(["bench", "--compare", old, "--to", new]) == 0
    out = capsys.readouterr().out
    assert "| fwd | B1 H8 L4096 D128 | solattn | 500 | 550 | 1.10x |" in out
    assert "| fwd | solattn | 2 | 1.100x |" in out


def test_compare_rejects_other_json(tmp_path, capsys):
    p = tmp_path / "other.json"
    p.write_text(json.dumps({"device": "H100", "fwd": []}))
    assert main(["bench", "--compare", str(p), "--to", str(p)]) == 2
    assert "expected a solattn bench JSON" in capsys.readouterr().err


def test_progress_without_a_tty():
    stream = io.StringIO()
    with Progress(3, "sweep", estimate_s=90, stream=stream) as prog:
        for what in ("a", "b", "c"):
            prog.start(what)
            prog.done()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[sweep 1/3, ETA 1m30s] a"
    assert lines[1].startswith("[sweep 2/3, ETA ") and lines[1].endswith("] b")
    assert lines[-1].startswith("[sweep] 3/3 in ")


def test_estimate_counts_cases_and_compiles():
    from solattn.bench import sweep

    shapes = sweep.sweep_shapes(sweep.SEQLENS, sweep.HEAD_DIMS)
    assert len(shapes) == 7 * 3 * 2
    assert shapes[0] == Shape(32, 32, 512, 512, 64) and shapes[6] == Shape(1, 32, 32768, 32768, 64)
    plan = sweep.Plan(shapes, [peers_mod.PEERS["cudnn"]], ["fwd", "bwd"])
    assert plan.timings == 84
    assert sweep.estimate_s(plan, []) == pytest.approx(84 * sweep.TIMING_S)
    flex = sweep.Plan(shapes, [peers_mod.PEERS["flex"]], ["fwd", "bwd", "fwdbwd"])
    # one compilation per shape without and one with gradients
    assert sweep.estimate_s(flex, []) == pytest.approx(126 * sweep.TIMING_S + 84 * 8.0)


# ---- the timing protocol and the suites ----------------------------------------------------


def test_time_rounds_median_spread_and_order():
    from solattn.bench.core import time_rounds

    times = {"a": iter([1.0, 1.1, 0.9]), "b": iter([2.0, 2.0, 2.0]), "c": iter([3.0])}
    seen = []

    def timer(fn):
        name = fn()
        seen.append(name)
        if name == "c" and len([s for s in seen if s == "c"]) == 2:
            raise RuntimeError("launch failed")
        return next(times[name])

    out = time_rounds({n: (lambda n=n: n) for n in "abc"}, rounds=3, timer=timer)
    # every round times each callable once, the order rotated by one each round; "c" failed
    # in round 2 and is not timed again
    assert seen == ["a", "b", "c", "b", "c", "a", "a", "b"]
    assert out["a"].rounds == [1.0, 1.1, 0.9] and out["a"].ms == 1.0
    assert out["a"].spread == pytest.approx(0.2) and out["a"].flagged
    assert out["b"].spread == 0 and not out["b"].flagged
    assert out["c"].rounds == [3.0] and out["c"].spread is None
    assert out["c"].note == "RuntimeError: launch failed"


def test_table_marks_rounds_that_disagree():
    from solattn.bench.core import Timing
    from solattn.bench.suite import Row, Suite, print_footer, print_row

    suite = Suite("t", "test", ("solattn-hopper", "cudnn"), baseline="cudnn")
    row = Row("B1 H8 L4096 D128", dict.fromkeys(suite.peers), work=4e12)
    timings = {"solattn-hopper": Timing([1.0, 1.0, 1.0]), "cudnn": Timing([1.2, 1.3, 1.25])}
    lines = []
    print_row(suite, row, list(suite.peers), timings, lines.append, header=True)
    assert lines[1] == "| TFLOP/s | solattn-hopper | cudnn | best solattn / cudnn | spread |"
    assert lines[-1] == "| B1 H8 L4096 D128 fwd | 4000 | 3200! | 1.25x | 8.0% |"
    lines.clear()
    print_row(suite, row, list(suite.peers), timings, lines.append, header=True, peak=800.0)
    assert lines[-3].endswith("| best solattn / cudnn | best solattn / SOL | spread |")
    assert lines[-1] == "| B1 H8 L4096 D128 fwd | 4000 | 3200! | 1.25x | 500% | 8.0% |"
    lines.clear()
    print_footer([(row, timings, {})], list(suite.peers), lines.append)
    assert lines[0].startswith("! rounds disagree by more than 3%")
    assert "B1 H8 L4096 D128 fwd cudnn: 8.0% (ms per round: 1.200, 1.300, 1.250)" in lines[1]


def test_list_names_every_suite(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("forward", "backward", "layer", "decode", "flex", "fp8", "dropout", "packed",
                 "paged-varlen", "sdpa-mask", "small-q", "varlen", "features", "model", "host",
                 "cold-start"):
        assert f"solattn bench --suite {name}" in out
    assert "torchrun --nproc_per_node 2 -m solattn.cli bench --suite ring" in out


@pytest.mark.parametrize("argv, message", [
    (["--suite", "nope"], "--suite: unknown ['nope']"),
    (["--suite", "varlen", "--peers", "cudnn"], "--peers: unknown ['cudnn'] for these suites"),
    (["--trees", "."], "--trees and --config apply to --suite"),
    (["--suite", "cold-start", "--config", "X=1"], "apply to table suites"),
    (["--suite", "varlen", "--config", "nokey"], "expected KEY=VALUE"),
    (["--suite", "varlen", "--trees", "/nonexistent"], "has no solattn/ package"),
    (["--suite", "varlen", "--rounds", "0"], "--rounds: expected a positive integer"),
])
def test_bad_suite_arguments_exit_2(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@cpu_only
def test_cpu_suite_says_once_that_nothing_is_timed(tmp_path, capsys):
    path = tmp_path / "varlen.json"
    assert main(["bench", "--suite", "varlen", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Timings need a CUDA GPU") == 1
    assert "solattn-hopper (needs sm_90)" in out
    assert "NotImplementedError" not in out and "all installed" not in out
    data = json.loads(path.read_text())
    assert data["mode"] == "suite:varlen" and data["results"] == []
    checks = data["verify"]
    assert checks and all(c["ok"] for c in checks)
    assert {c["name"] for c in checks} == {"solattn", "solattn-portable"}
    assert all(c["err"] is not None and c["err"] <= c["bound"] for c in checks)


@cpu_only
def test_cpu_default_mode_header_and_hopper_row(capsys):
    assert main(["bench", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "all installed" not in out and "nothing is timed" in out


@cpu_only
def test_suite_check_failure_exits_nonzero(monkeypatch, capsys):
    import torch

    from solattn.bench import suites
    from solattn.bench.suite import Row, Suite

    ref = torch.ones(2, 3)
    suite = Suite("t", "a suite with one wrong call", ("solattn", "wrong"), lambda ctx: [
        Row("B1 H1 L3 D2", {"solattn": lambda: (lambda: ref.clone()),
                            "wrong": lambda: (lambda: ref + 1)}, reference=lambda: ref)])
    monkeypatch.setitem(suites.SUITES, "t", suite)
    assert main(["bench", "--suite", "t"]) == 1
    out, err = capsys.readouterr()
    assert "1 calls ok, 1 FAILED" in out and "FAILED t: B1 H1 L3 D2 fwd: wrong max err" in out
    assert "verification FAILED (1 check(s))" in err


def test_config_variants():
    from solattn.bench.ab import parse_config, variants

    assert parse_config("a.b=64,C=True,D=abc") == {"a.b": 64, "C": True, "D": "abc"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_config("a.b")
    labels = [v.label for v in variants(None, ["fwd_config.num_warps=2"])]
    assert labels == ["base", "fwd_config.num_warps=2"]


def test_apply_config_reaches_every_importer():
    """In a fresh process: a config function's field and a module constant are overridden
    wherever solattn imported them."""
    code = (
        "import sys\n"
        "from solattn.bench.ab import apply_config\n"
        "lines = apply_config({'fwd_config.num_warps': 2, 'HALF_CTA_MAX_BLOCKS': 3})\n"
        "from solattn import configs\n"
        "assert configs.fwd_config(90, 64, 64, False).num_warps == 2\n"
        "held = [m.HALF_CTA_MAX_BLOCKS for n, m in list(sys.modules.items())\n"
        "        if n.startswith('solattn.') and hasattr(m, 'HALF_CTA_MAX_BLOCKS')]\n"
        "assert held and set(held) == {3}, held\n"
        "print(lines)\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "fwd_config.num_warps=2 in " in res.stdout and "solattn.configs" in res.stdout


@cpu_only
def test_trees_run_this_harness_against_each_tree(capsys):
    """One worker process (a tree; the config overrides a worker applies are tested above):
    this tree's harness, loaded under another name, runs the tree's solattn."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert main(["bench", "--suite", "small-q", "--peers", "solattn", "--shapes", "Lq1",
                 "--trees", f"a={root}"]) == 0
    out = capsys.readouterr().out
    assert f"variant a: solattn {__import__('solattn').__version__} from " \
           f"{os.path.join(root, 'solattn')}" in out
    assert "small-q: 1 rows, 1 calls ok (solattn@a)" in out
    assert "ok [a] small-q: B1 H4 Hkv2 Lq1 Lk70 D32 causal fwd: solattn max err" in out


@cpu_only
def test_trees_import_the_tree_not_the_working_directory(tmp_path, monkeypatch, capsys):
    """Run from a checkout (``python -c`` puts the working directory first on sys.path), a
    tree elsewhere is still the solattn its worker imports."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tmp_path / "old"
    shutil.copytree(os.path.join(root, "solattn"), tree / "solattn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(root)
    assert main(["bench", "--suite", "small-q", "--peers", "solattn", "--shapes", "Lq1",
                 "--trees", f"old={tree}"]) == 0
    out = capsys.readouterr().out
    assert f"variant old: solattn {__import__('solattn').__version__} from " \
           f"{tree / 'solattn'}" in out


def test_tree_workers_import_no_module_from_outside_the_tree(tmp_path):
    """A tree variant's worker finds only the tree's modules: one the tree lacks (here
    ``aot_cache``, as a module added since an old tree) does not come from an installed
    checkout (an editable install's import hook would find it there)."""
    import shutil
    import subprocess
    import sys

    from solattn.bench.ab import ISOLATE

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tmp_path / "old"
    shutil.copytree(os.path.join(root, "solattn"), tree / "solattn",
                    ignore=shutil.ignore_patterns("__pycache__", "aot_cache.py"))
    probe = ("import importlib.util, os, solattn\n"
             "print(os.path.dirname(solattn.__file__))\n"
             "print(importlib.util.find_spec('solattn.aot_cache'))\n")
    res = subprocess.run([sys.executable, "-c", ISOLATE.format(tree=str(tree)) + probe],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == [str(tree / "solattn"), "None"]


def test_check_tree_refuses_a_worker_that_imported_another_solattn(tmp_path):
    from solattn.bench.ab import Variant, check_tree

    check_tree(Variant("a", str(tmp_path)), str(tmp_path / "solattn"))
    check_tree(Variant("base"), "/anywhere/solattn")
    with pytest.raises(RuntimeError, match="imported solattn from /elsewhere/solattn, not "
                                           "from its tree"):
        check_tree(Variant("a", str(tmp_path)), "/elsewhere/solattn")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (clocks)")
def test_settle_clocks_on_the_gpu():
    from solattn.bench.core import settle_clocks

    s = settle_clocks(max_s=10.0)
    assert s["rates"] and all(r > 0 for r in s["rates"])
    if s["settled"]:
        assert abs(s["rates"][-1] - s["rates"][-2]) <= 0.01 * s["rates"][-2]


def test_table_leaves_out_peers_that_ran_nowhere():
    from solattn.bench.core import Timing
    from solattn.bench.suite import Row, Suite, print_table

    suite = Suite("t", "test", ("solattn-hopper", "cudnn", "fa4"), baseline="cudnn")
    rows = [Row(label, dict.fromkeys(suite.peers), work=4e12) for label in ("A", "B")]
    table = [(rows[0], {"solattn-hopper": Timing([1.0]), "cudnn": Timing([1.25])},
              {"fa4": "flash_attn.cute not importable (ModuleNotFoundError)"}),
             (rows[1], {"solattn-hopper": Timing([2.0]), "cudnn": Timing([2.0])}, {})]
    lines = []
    print_table(suite, table, list(suite.peers), lines.append)
    assert lines[1] == "| TFLOP/s | solattn-hopper | cudnn | best solattn / cudnn | spread |"
    assert lines[3:5] == ["| A fwd | 4000 | 3200 | 1.25x | - |",
                          "| B fwd | 2000 | 2000 | 1.00x | - |"]
    assert lines[-1] == "not timed: fa4 (flash_attn.cute not importable (ModuleNotFoundError))"


def test_ab_rounds_keep_directions_apart(monkeypatch):
    """A suite timing one shape forward and backward (flex) gives rows that share a label: the
    A/B driver keeps each (label, direction) its own row, so no row's rounds mix fwd and bwd."""
    from solattn.bench import ab
    from solattn.bench.results import Results
    from solattn.bench.suite import Context, Suite

    class Proc:
        stdin = type("In", (), {"write": lambda self, s: None, "flush": lambda self: None})()

        def wait(self, timeout=None):
            return 0

    def reply(proc, cmd):
        if cmd == "hello":
            return dict(solattn="0", path="p", config=[])
        row = dict(label="B1 H2 L64 D32 causal", work=4e12, unit="TFLOP/s", notes={})
        return dict(rows=[dict(row, section="fwd", ms={"solattn": 1.0}),
                          dict(row, section="bwd", ms={"solattn": 3.0})])

    monkeypatch.setattr(ab, "_spawn", lambda variant, spec: Proc())
    monkeypatch.setattr(ab, "_ask", reply)
    suite = Suite("t", "test", ("solattn",))
    lines = []
    ab.run_variants(suite, Context(rounds=3), Results("ab", {}),
                    [ab.Variant("old"), ab.Variant("new")], lines.append)
    rows = [ln for ln in lines if ln.startswith("| B1")]
    assert rows == ["| B1 H2 L64 D32 causal fwd | 4000 | 4000 | 0.0% |",
                    "| B1 H2 L64 D32 causal bwd | 1333 | 1333 | 0.0% |"]


def test_model_suite_names_the_sdpa_backend():
    """The model suite's training rows name the backend torch's SDPA dispatch picks for the
    model's own calls (a spy on ``scaled_dot_product_attention`` during one step), and the spy
    is gone afterwards."""
    import torch
    from torch.nn.attention import SDPBackend

    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    from solattn.bench.suites.model import sdpa_backends

    device = "cuda" if ON_GPU else "cpu"
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    original = torch.nn.functional.scaled_dot_product_attention
    ids = torch.randint(1, 128, (1, 32), device=device)
    names = sdpa_backends(model, ids).split("/")
    assert names and all(n.isupper() and hasattr(SDPBackend, n) for n in names), names
    assert torch.nn.functional.scaled_dot_product_attention is original
