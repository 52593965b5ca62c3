"""Progress of a long benchmark: what is being compiled or timed, how many are left, an ETA.

A tqdm bar on stderr when stderr is a terminal and tqdm is installed; otherwise one plain line per
item (logs, CI, a device run whose output is captured), so nothing depends on a TTY. Tables go to
stdout through :meth:`Progress.write`, which keeps them clear of the bar.
"""

from __future__ import annotations

import sys
import time


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """``total`` items; :meth:`start` names the next one, :meth:`done` counts it.

    ``estimate_s`` (the up-front estimate) gives the ETA until measured rates take over.
    """

    def __init__(self, total: int, desc: str, estimate_s: float | None = None,
                 stream=None, bar: bool | None = None):
        self.total = max(total, 0)
        self.desc = desc
        self.count = 0
        self.t0 = time.perf_counter()
        self.estimate_s = estimate_s
        self.stream = stream or sys.stderr
        self._bar = None
        if bar is None:
            bar = bool(getattr(self.stream, "isatty", lambda: False)())
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=self.total, desc=desc, file=self.stream, dynamic_ncols=True)

    def eta_s(self) -> float | None:
        elapsed = time.perf_counter() - self.t0
        if self.count:
            return elapsed / self.count * (self.total - self.count)
        if self.estimate_s is not None:
            return max(self.estimate_s - elapsed, 0.0)
        return None

    def start(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what[:60])
            return
        eta = self.eta_s()
        eta_txt = f", ETA {_fmt_s(eta)}" if eta is not None else ""
        print(f"[{self.desc} {self.count + 1}/{self.total}{eta_txt}] {what}", file=self.stream,
              flush=True)

    def done(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)

    def write(self, line: str = "") -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elapsed = time.perf_counter() - self.t0
        print(f"[{self.desc}] {self.count}/{self.total} in {_fmt_s(elapsed)}", file=self.stream,
              flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
