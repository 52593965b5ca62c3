"""pytest plugin for tools/flash_attn_tests.sh: runs a sample of flash-attention's own
tests/test_flash_attn.py grid against solattn (through the ``flash_attn`` stand-in package of
the git-ignored ``.fa_tests/`` folder).

``--fa-sample N``: keep about N cases, covering every test function and every value of each of
its parameters (greedy: a case is kept while it adds an uncovered (function, parameter, value);
the rest of each function's share is drawn at random, seeded by ``--fa-seed``). Left out, and
counted apart: cases that read flash-attn's testing-only dropout matrix (``S_dmask``, returned
with ``dropout_p > 0``, which solattn does not produce) and the test of flash-attn's compiled
extension module (``flash_attn_gpu``). ``--fa-shard I/N``: only the I-th of N shares of that sample (N processes run it in parallel;
collecting the grid takes minutes in each). ``--fa-cpu``: a dry run on the CPU (device "cuda" made
"cpu", a capability of 9.0 reported) to catch import and collection problems without a GPU.
"""

from __future__ import annotations

import functools
import inspect
import random
from collections import defaultdict

import pytest

NEEDS_EXTENSION = ("test_flash_attn_generator_arg_must_be_none",)


def pytest_addoption(parser):
    parser.addoption("--fa-sample", type=int, default=0, help="keep about N cases (0: all)")
    parser.addoption("--fa-seed", type=int, default=0)
    parser.addoption("--fa-cpu", action="store_true", help="dry run on the CPU")
    parser.addoption("--fa-shard", default="", help="I/N: run the sample's I-th of N shares "
                     "(processes in parallel: the sample is the same in each)")


def pytest_configure(config):
    if config.getoption("--fa-cpu"):
        _cpu_dry_run()


def _cpu_dry_run():
    """Tensors asked for on "cuda" are made on the CPU (Triton's interpreter runs solattn)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu(device):
        return "cpu" if device is not None and "cuda" in str(device) else device

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func in (torch.Tensor.to, torch.Tensor.cuda):
                args = tuple(cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
                if func is torch.Tensor.cuda:
                    return args[0]
            return func(*args, **kwargs)

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    CudaToCpu().__enter__()


def _reads_dropout_matrix(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if not params.get("dropout_p", 0.0):
        return False
    return _reads_s_dmask(item.function)


@functools.lru_cache(maxsize=None)
def _reads_s_dmask(function) -> bool:
    return "S_dmask" in inspect.getsource(function)


def pytest_collection_modifyitems(config, items):
    n = config.getoption("--fa-sample")
    out = {id(it) for it in items
           if _reads_dropout_matrix(it) or it.originalname in NEEDS_EXTENSION}
    left_out = [it for it in items if id(it) in out]
    kept = [it for it in items if id(it) not in out]
    by_fn = defaultdict(list)
    for it in kept:
        by_fn[it.originalname].append(it)
    if n:
        rng = random.Random(config.getoption("--fa-seed"))
        share = max(1, n // max(1, len(by_fn)))
        sample = set()
        for cases in by_fn.values():
            rng.shuffle(cases)
            chosen, covered = set(), set()
            for i, it in enumerate(cases):  # cover every parameter value
                spec = getattr(it, "callspec", None)
                keys = {(k, repr(v)) for k, v in spec.params.items()} if spec else {("", "")}
                if keys - covered:
                    chosen.add(i)
                    covered |= keys
            for i in range(len(cases)):
                if len(chosen) >= share:
                    break
                chosen.add(i)
            sample |= {id(cases[i]) for i in chosen}
        left_out += [it for it in kept if id(it) not in sample]
        kept = [it for it in kept if id(it) in sample]
    shard = config.getoption("--fa-shard")
    if shard:
        i, n_shards = map(int, shard.split("/"))
        kept.sort(key=lambda it: it.nodeid)
        left_out += [it for j, it in enumerate(kept) if j % n_shards != i]
        kept = [it for j, it in enumerate(kept) if j % n_shards == i]
    dropped = len(items) - len(kept)
    items[:] = kept
    config.hook.pytest_deselected(items=left_out)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        matrix = sum(1 for it in left_out if _reads_dropout_matrix(it))
        ext = sum(1 for it in left_out if it.originalname in NEEDS_EXTENSION)
        reporter.write_line(
            f"fa_sample: {len(kept)} cases over {len(by_fn)} test functions kept of "
            f"{len(items) + dropped}; left out: {matrix} reading the dropout matrix S_dmask, "
            f"{ext} of flash_attn_gpu (flash-attn's compiled extension), the rest unsampled")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    stats = terminalreporter.stats
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "error", "skipped")}
    terminalreporter.write_line(
        "fa_sample counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    by_fn = defaultdict(lambda: [0, 0])
    for rep in stats.get("passed", []) + stats.get("failed", []):
        fn = rep.nodeid.split("::")[-1].split("[")[0]
        by_fn[fn][rep.outcome == "failed"] += 1
    for fn, (ok, bad) in sorted(by_fn.items()):
        terminalreporter.write_line(f"  {fn}: {ok} passed, {bad} failed")
