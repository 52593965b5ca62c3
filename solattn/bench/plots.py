"""PNG charts of a sweep (matplotlib, imported only here and only when plotting).

One figure per (direction, head dim), as flash-attn's README charts: grouped bars of TFLOP/s by
sequence length, one bar per implementation, no mask on the left and causal on the right, and
the run's bf16 matmul (speed of light) as a dashed line.
"""

from __future__ import annotations

import os

from .core import DIRECTIONS

TITLES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _seq_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def write_plots(data: dict, out_dir: str) -> list[str]:
    """Write the sweep's figures for results file contents ``data`` into ``out_dir``; returns
    the paths. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .peers import PEERS

    records = [r for r in data["results"] if r.get("section") in DIRECTIONS and "d" in r]
    order = list(PEERS) + sorted({r["name"] for r in records} - set(PEERS))
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(order)}
    env, sol = data.get("env", {}), data.get("sol_tflops")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for direction in DIRECTIONS:
        for d in sorted({r["d"] for r in records if r["section"] == direction}):
            group = [r for r in records if r["section"] == direction and r["d"] == d]
            names = [n for n in order if any(r["name"] == n and r["value"] for r in group)]
            if not names:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
            for ax, causal in zip(axes, (False, True)):
                part = [r for r in group if r["causal"] == causal]
                seqlens = sorted({r["s_q"] for r in part})
                value = {(r["name"], r["s_q"]): r["value"] for r in part}
                width = 0.84 / len(names)
                for i, name in enumerate(names):
                    xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(seqlens))]
                    ys = [value.get((name, n)) or 0.0 for n in seqlens]
                    bars = ax.bar(xs, ys, width, label=name, color=colors[name])
                    for bar, y in zip(bars, ys):
                        if y:
                            ax.annotate(f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, y),
                                        ha="center", va="bottom", fontsize=6, rotation=90,
                                        xytext=(0, 2), textcoords="offset points")
                ax.set_xticks(range(len(seqlens)), [_seq_label(n) for n in seqlens])
                ax.set_xlabel("sequence length")
                ax.set_title("causal" if causal else "no mask")
                if sol:
                    ax.axhline(sol, ls="--", lw=0.8, color="gray")
                    ax.annotate(f"bf16 matmul {sol:.0f}", (0, sol), xytext=(2, 2),
                                textcoords="offset points", fontsize=7, color="gray",
                                xycoords=("axes fraction", "data"))
                ax.grid(axis="y", lw=0.3)
            axes[0].set_ylabel("TFLOP/s")
            batches = sorted({(r["s_q"], r["b"]) for r in group})
            widths = sorted({r["h"] * r["d"] for r in group})
            sub = ("batch: " + ", ".join(f"{b} at {_seq_label(n)}" for n, b in batches)
                   + f"; heads x head dim = {'/'.join(map(str, widths))}")
            fig.suptitle(f"{TITLES[direction]}, head dim {d} - {env.get('device', '?')}, "
                         f"{data.get('dtype', '')}\n{sub}", fontsize=10)
            axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
            path = os.path.join(out_dir, f"{direction}_d{d}.png")
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
    return paths
