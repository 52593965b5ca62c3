"""The JSON every ``solattn bench`` mode writes, its tables, and ``--compare``.

Schema (``"schema": "solattn-bench/1"``)::

    {"schema": ..., "mode": "anchors" | "ladder" | "sweep",
     "env": {device, capability, sms, driver, sm_clock_mhz, torch, triton, solattn, date, ...},
     "dtype": "bfloat16", "sol_tflops": float | null,      # bf16 8192^3 matmul, same run
     "verify": [{name, shape, what: out|dq|dk|dv|grads, ok: true|false|null, err, bound, note}],
     "results": [{section: fwd|bwd|fwdbwd|decode|ladder, name, shape, b, h, h_kv, s_q, s_k, d,
                  d_v, causal, ms, value, unit: "TFLOP/s" | "GB/s", note, ...}]}

A result with ``value: null`` did not run; ``note`` says why. The file is rewritten after every
result, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import math
import os

SCHEMA = "solattn-bench/1"
RESULT_KEYS = ("section", "name", "shape", "ms", "value", "unit", "note")


def make_record(section: str, name: str, shape, *, ms=None, value=None, unit="TFLOP/s",
                note=None, **extra) -> dict:
    """One result; ``shape`` a :class:`~solattn.bench.core.Shape` or a label string."""
    rec = dict(section=section, name=name,
               shape=shape if isinstance(shape, str) else shape.label())
    if not isinstance(shape, str):
        rec.update(shape.as_dict())
    rec.update(ms=ms, value=value, unit=unit, note=note)
    rec.update(extra)
    return rec


class Results:
    """Accumulates one run's results; writes them to ``path`` (if any) after each change."""

    def __init__(self, mode: str, env: dict, path: str | None = None, dtype: str = "bfloat16",
                 args: dict | None = None):
        self.path = path
        self.data = {"schema": SCHEMA, "mode": mode, "env": env, "dtype": dtype,
                     "args": args or {}, "sol_tflops": None, "verify": [], "results": []}

    @property
    def records(self) -> list[dict]:
        return self.data["results"]

    def add(self, rec: dict) -> dict:
        self.data["results"].append(rec)
        self.save()
        return rec

    def add_checks(self, entries) -> None:
        self.data["verify"].extend(entries)
        self.save()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    @property
    def verified(self) -> bool:
        return all(e["ok"] is not False for e in self.data["verify"])

    def save(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_clean(self.data), f, indent=1, default=str)
        os.replace(tmp, self.path)


def _clean(x):
    """Strict JSON: a non-finite float (an error of inf from NaN output) becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def load(path: str) -> dict:
    """A results file written by ``solattn bench`` (any mode); ValueError if it is not one."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: expected a solattn bench JSON ({SCHEMA!r}), got schema "
                         f"{data.get('schema') if isinstance(data, dict) else type(data).__name__}")
    return data


# ---- tables ---------------------------------------------------------------------------------


def fmt(value, digits: int | None = None) -> str:
    """A table cell: ``-`` for no value; whole numbers from 10 up, a decimal or two below."""
    if value is None:
        return "-"
    if digits is None:
        digits = 0 if abs(value) >= 10 else 1 if abs(value) >= 1 else 2
    return f"{value:.{digits}f}"


def pivot(records, section: str, names) -> list[dict]:
    """Rows ``{"shape", "kind", name: value, ...}`` of one section, shapes in first-seen order."""
    rows: dict[str, dict] = {}
    for r in records:
        if r["section"] != section or r["name"] not in names:
            continue
        row = rows.setdefault(r["shape"], {"shape": r["shape"], "kind": section})
        row[r["name"]] = r["value"]
    return list(rows.values())


def print_table(rows, names, sol, out=print) -> None:
    """Markdown table: TFLOP/s per peer, best solattn as % of SOL and as a ratio to cuDNN."""
    out("")
    out("| shape | " + " | ".join(names) + " | best solattn / SOL | / cuDNN |")
    out("|" + "---|" * (len(names) + 3))
    for r in rows:
        cells = [fmt(r.get(n)) for n in names]
        ours = [r[n] for n in names if n.startswith("solattn") and r.get(n)]
        best = max(ours) if ours else None
        sol_pct = f"{100 * best / sol:.0f}%" if best and sol else "-"
        vs = f"{best / r['cudnn']:.2f}x" if best and r.get("cudnn") else "-"
        out(f"| {r['shape']} {r['kind']} | " + " | ".join(cells) + f" | {sol_pct} | {vs} |")


# ---- --compare ------------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    return (r["section"], r["name"], r["shape"])


def compare(old: dict, new: dict) -> list[dict]:
    """Results present in both runs (same section, implementation and shape) with a value in
    each: ``{section, name, shape, unit, old, new, ratio}`` (ratio = new / old)."""
    before = {_key(r): r for r in old["results"] if r.get("value")}
    rows = []
    for r in new["results"]:
        o = before.get(_key(r))
        if o is None or not r.get("value"):
            continue
        rows.append(dict(section=r["section"], name=r["name"], shape=r["shape"],
                         unit=r.get("unit", "TFLOP/s"), old=o["value"], new=r["value"],
                         ratio=r["value"] / o["value"]))
    return rows


def print_compare(rows, old_label: str, new_label: str, out=print) -> None:
    """Ratios per result, then the geometric mean per (section, implementation)."""
    out("")
    out(f"compare: new = {new_label}, old = {old_label}")
    if not rows:
        out("  no result in common (same section, implementation and shape)")
        return
    out("| section | shape | implementation | old | new | new / old |")
    out("|---|---|---|---|---|---|")
    for r in rows:
        out(f"| {r['section']} | {r['shape']} | {r['name']} | {r['old']:.0f} | {r['new']:.0f} | "
            f"{r['ratio']:.2f}x |")
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["section"], r["name"]), []).append(r["ratio"])
    out("")
    out("| section | implementation | results | geometric mean new / old |")
    out("|---|---|---|---|")
    for (section, name), ratios in groups.items():
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        out(f"| {section} | {name} | {len(ratios)} | {gm:.3f}x |")
