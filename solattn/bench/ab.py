"""Same-run A/B: ``solattn bench --suite NAME --trees A B`` and ``--config KEY=VAL``.

Each variant -- a source tree (``PYTHONPATH=A``) and/or a config override -- gets one worker
process that stays up for the whole run. The rounds interleave: in round r every worker times
the suite's rows once (each row's calls once each, the same timer as a plain run), the order
of the workers rotated by one each round; the tables give each (row, peer, variant) the median
of its rounds and their spread, as a plain run does.

The worker runs *this* tree's harness (this package, loaded under another name, so a tree
from before the harness existed can be measured) against the tree's ``solattn``: the calls go
through the public API of the tree under test.

``--config KEY=VAL[,KEY=VAL...]`` (repeatable: one variant each; the unchanged code is always
the first variant) overrides, in the worker before its first call:

* ``FUNCTION.FIELD=VALUE``: a field of the frozen config a config function of solattn returns,
  e.g. ``hopper_fwd_config.persistent=True`` or ``fwd_config.num_stages=3``
  (``dataclasses.replace`` on every result of the function, wherever it is imported);
* ``NAME=VALUE``: a module-level constant of solattn's modules, e.g.
  ``HALF_CTA_MAX_BLOCKS=8``.

Values are Python literals (``64``, ``True``, ``(64, 128)``); anything else is a string.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import time

HARNESS_ALIAS = "solattn_bench_harness"


def parse_config(text: str) -> dict:
    """``"a.b=1,C=x"`` -> ``{"a.b": 1, "C": "x"}``; ValueError on a malformed item."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config: expected KEY=VALUE items, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def _solattn_modules() -> list:
    """solattn's modules that hold configs and constants: the package, its configs and kernels
    (imported here, so an override reaches them before the first call)."""
    import solattn

    for name in ("solattn.configs", "solattn.kernels", "solattn.flex", "solattn.launch"):
        try:
            pkg = importlib.import_module(name)
        except ImportError:
            continue
        for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), prefix=name + "."):
            try:
                importlib.import_module(info.name)
            except ImportError:
                pass
    del solattn
    return [m for n, m in sorted(sys.modules.items())
            if m is not None and (n == "solattn" or n.startswith("solattn."))
            and not n.startswith("solattn.bench")]


def apply_config(overrides: dict) -> list[str]:
    """Apply ``overrides`` (see the module docstring) to the loaded solattn; returns one line
    per override saying where it went. ValueError when a key names nothing."""
    modules = _solattn_modules()
    done = []
    for key, value in overrides.items():
        func_name, _, fld = key.partition(".")
        hits = [(m, func_name) for m in modules if callable(getattr(m, func_name, None))
                and not isinstance(getattr(m, func_name), type)] if fld else \
               [(m, key) for m in modules if key in vars(m)]
        if not hits:
            raise ValueError(f"--config {key}: no solattn module defines "
                             f"{'a function ' + func_name if fld else key!r}")
        if fld:
            originals = {id(getattr(m, a)): getattr(m, a) for m, a in hits}
            for orig in originals.values():
                wrapped = _override_field(orig, fld, value)
                for m, a in hits:
                    if getattr(m, a) is orig:
                        setattr(m, a, wrapped)
        else:
            for m, a in hits:
                setattr(m, a, value)
        where = sorted({m.__name__ for m, _ in hits})
        done.append(f"{key}={value!r} in {', '.join(where)}")
    return done


def _override_field(fn, fld: str, value):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        cfg = fn(*args, **kwargs)
        if cfg is None:
            return cfg
        if not dataclasses.is_dataclass(cfg):
            raise TypeError(f"--config {fn.__name__}.{fld}: {fn.__name__} returned "
                            f"{type(cfg).__name__}, not a config dataclass")
        return dataclasses.replace(cfg, **{fld: value})
    return wrapper


# ---- variants and workers -------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    label: str
    tree: str | None = None
    config: dict = dataclasses.field(default_factory=dict)


def variants(trees, configs) -> list[Variant]:
    """One variant per tree (``PATH`` or ``NAME=PATH``) x (the unchanged code, each config)."""
    tree_list = []
    for t in trees or [None]:
        if t is None:
            tree_list.append((None, None))
            continue
        name, sep, path = t.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.abspath(t)) or t, t
        if not os.path.isdir(os.path.join(path, "solattn")):
            raise ValueError(f"--trees: {path!r} has no solattn/ package")
        tree_list.append((name, os.path.abspath(path)))
    names = [n for n, _ in tree_list]
    if len(set(names)) != len(names):  # two trees of the same basename
        tree_list = [(f"{n}{i}", p) for i, (n, p) in enumerate(tree_list)]
    cfgs = [("", {})] + [(c, parse_config(c)) for c in configs or []]
    out = []
    for tname, path in tree_list:
        for ctext, cfg in cfgs:
            label = "+".join(x for x in (tname, ctext) if x) or "base"
            out.append(Variant(label, path, cfg))
    return out


# A tree variant's worker sees only the tree's solattn: its directory goes first on sys.path
# (``python -c`` puts the working directory ahead of PYTHONPATH, so run from a checkout the
# worker would import the checkout's solattn), and the import hooks of an editable install go
# (they resolve a module the tree lacks, e.g. one added since, from the installed checkout).
ISOLATE = """
import sys
if {tree!r}:
    sys.path.insert(0, {tree!r})
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not str(getattr(f, "__module__", "")).startswith("__editable__")]
"""
_BOOT = ISOLATE + """
import importlib.util
spec = importlib.util.spec_from_file_location({alias!r}, {init!r},
                                              submodule_search_locations=[{pkg!r}])
mod = importlib.util.module_from_spec(spec)
sys.modules[{alias!r}] = mod
spec.loader.exec_module(mod)
importlib.import_module({alias!r} + ".ab").worker_main(sys.argv[1])
"""


def _spawn(variant: Variant, spec: dict):
    pkg = os.path.dirname(os.path.abspath(__file__))
    boot = _BOOT.format(alias=HARNESS_ALIAS, init=os.path.join(pkg, "__init__.py"), pkg=pkg,
                        tree=variant.tree or "")
    env = dict(os.environ)
    if variant.tree:
        env["PYTHONPATH"] = os.pathsep.join(
            [variant.tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    arg = json.dumps(dict(spec, config=variant.config))
    return subprocess.Popen([sys.executable, "-c", boot, arg], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def check_tree(variant: Variant, path: str) -> None:
    """RuntimeError unless a tree variant's worker imported solattn from that tree."""
    if variant.tree and os.path.commonpath([os.path.realpath(path),
                                            os.path.realpath(variant.tree)]) != \
            os.path.realpath(variant.tree):
        raise RuntimeError(f"--trees: variant {variant.label!r} imported solattn from {path}, "
                           f"not from its tree {variant.tree}")


def _ask(proc, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline()
    if not reply:
        raise RuntimeError(f"a bench worker exited (code {proc.wait()}); its errors are above")
    return json.loads(reply)


def run_variants(suite, ctx, res, variant_list, out=print) -> dict:
    """Time ``suite`` in one worker per variant, interleaved rounds; tables as a plain run's."""
    from .core import Timing
    from .suite import Row, print_table, record

    spec = dict(suite=suite.name, quick=ctx.quick, shapes=ctx.shapes, peers=ctx.peers)
    procs = [_spawn(v, spec) for v in variant_list]
    summary = {"rows": 0, "checked": [], "failed": [], "not_run": {}, "ran": set()}
    try:
        hello = [_ask(p, "hello") for p in procs]
        for v, h in zip(variant_list, hello):
            out(f"variant {v.label}: solattn {h['solattn']} from {h['path']}"
                + "".join(f"\n  config {line}" for line in h["config"]))
            check_tree(v, h["path"])
        if ctx.cpu:
            for v, p in zip(variant_list, procs):
                reply = _ask(p, "check")
                for key in ("checked", "failed"):
                    summary[key] += [f"[{v.label}] {e}" for e in reply[key]]
                summary["rows"] += reply["rows"]
                summary["ran"] |= {f"{n}@{v.label}" for n in reply["ran"]}
                summary["not_run"].update(reply["not_run"])
            return summary
        # (label, section) -> {"row": {...}, "cells": {name: Timing}, "notes": {}}: a suite may
        # time one shape in both directions (flex: fwd and bwd rows share the label)
        data: dict = {}
        for r in range(ctx.rounds):
            k = r % len(procs)
            for i in list(range(k, len(procs))) + list(range(k)):
                reply = _ask(procs[i], "round")
                for row in reply["rows"]:
                    slot = data.setdefault((row["label"], row["section"]),
                                           {"row": row, "cells": {}, "notes": {}})
                    for peer, ms in row["ms"].items():
                        name = f"{peer}@{variant_list[i].label}"
                        t = slot["cells"].setdefault(name, Timing())
                        if ms is not None:
                            t.rounds.append(ms)
                        elif row["notes"].get(peer):
                            slot["notes"][name] = row["notes"][peer]
        table = []
        for (label, _), slot in data.items():
            meta = slot["row"]
            names = list(slot["cells"])
            row = Row(label, dict.fromkeys(names), work=meta["work"], unit=meta["unit"],
                      section=meta["section"])
            for n in names:
                record(res, row, n, slot["cells"][n], slot["notes"].get(n))
            table.append((row, slot["cells"], slot["notes"]))
            summary["rows"] += 1
        names = list(dict.fromkeys(n for _, c, _ in table for n in c))
        print_table(suite, table, names, out, ctx.peaks)
    finally:
        for p in procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
            p.wait(timeout=60)
    return summary


def worker_main(arg: str) -> None:
    """A worker: apply the config, then answer ``hello`` / ``round`` / ``check`` / ``quit``
    lines on stdin with one JSON line each on stdout (everything else printed goes to
    stderr)."""
    import torch

    import solattn

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    spec = json.loads(arg)
    config_lines = apply_config(spec["config"])
    from .core import IDLE_GAP_S, settle_clocks
    from .results import Results
    from .suite import Context, build_calls, label_matches, run_rows, selected, timer_of
    from .suites import SUITES

    suite = SUITES[spec["suite"]]
    cuda = torch.cuda.is_available()
    ctx = Context(device="cuda" if cuda else "cpu",
                  dtype=torch.bfloat16 if cuda else torch.float16, quick=spec["quick"],
                  shapes=spec["shapes"], peers=spec["peers"], rounds=1)
    if cuda:
        settle_clocks()

    def reply(obj):
        proto.write(json.dumps(obj, default=str) + "\n")
        proto.flush()

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "hello":
            reply(dict(solattn=getattr(solattn, "__version__", "?"),
                       path=os.path.dirname(os.path.abspath(solattn.__file__)),
                       config=config_lines))
        elif cmd == "check":
            s = run_rows(suite, ctx, Results("ab", {}))
            reply(dict(s, ran=sorted(s["ran"])))
        elif cmd == "round":
            rows = []
            names = selected(suite, ctx)
            for row in suite.rows(ctx):
                if not label_matches(row.label, ctx.shapes):
                    continue
                t_build = time.perf_counter()
                fns, notes = build_calls(row, names, ctx)
                if cuda and time.perf_counter() - t_build > IDLE_GAP_S:
                    settle_clocks(max_s=3.0)  # compilations left the GPU idle
                timer = timer_of(row)
                ms = {}
                for n in names:
                    if n not in row.calls:
                        continue
                    ms[n] = None
                    if n in fns:
                        try:
                            ms[n] = float(timer(fns[n]))
                        except Exception as exc:  # noqa: BLE001 - reported in the table
                            notes[n] = f"{type(exc).__name__}: {exc}"[:160]
                rows.append(dict(label=row.label, work=row.work, unit=row.unit,
                                 section=row.section, ms=ms, notes=notes))
                del fns
                if cuda:
                    torch.cuda.empty_cache()
            reply(dict(rows=rows))
        elif cmd == "quit":
            break
