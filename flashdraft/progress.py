"""Progress bars that suit both a terminal and a log file.

On a terminal: tqdm's bar, redrawn in place. Anywhere else (CI, SLURM, `| tee`): one plain
line at most every `LOG_INTERVAL_S` seconds and one at the end, without carriage returns,
so a log holds a readable line per interval instead of hundreds of redraws a minute.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_S = 10.0


class Progress(tqdm):
    """`tqdm` with the same arguments; plain lines when its output is not a terminal."""

    def __init__(self, *args, **kwargs) -> None:
        out = kwargs.get("file") or sys.stderr
        self.plain = not (hasattr(out, "isatty") and out.isatty())
        self._finished_shown = False
        if self.plain:
            kwargs["mininterval"] = max(kwargs.get("mininterval", 0.1), LOG_INTERVAL_S)
            kwargs["dynamic_ncols"] = False
            kwargs.setdefault("bar_format", "{l_bar} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        super().__init__(*args, **kwargs)
        if self.plain and not self.disable:
            self.fp = _WholeLines(self.fp)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self.plain:
            return super().display(msg, pos)
        line = self.__str__() if msg is None else msg
        finished = msg is None and self.total is not None and self.n >= self.total
        if line and not (finished and self._finished_shown):  # close() redraws the last line: once is enough
            self.fp.write(line + "\n")
            self.fp.flush()
            self._finished_shown = finished
        return True


class _WholeLines:
    """The bar's output file, minus the bare newlines and carriage returns tqdm writes to
    move around a terminal (plain mode writes whole lines itself)."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, text: str) -> None:
        if text.strip("\r\n"):
            self.file.write(text)

    def flush(self) -> None:
        self.file.flush()
