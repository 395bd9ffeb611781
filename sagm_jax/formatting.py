"""How values and durations are written for people: one form each, everywhere.

``flag_value`` is a config value as ``--config.KEY=`` takes it back (the command line,
the sweep's job commands, the config's error messages); ``duration`` is a wall time
(the run's "Wall time", the sweep's progress and ETA); ``progress`` is a progress bar:
tqdm's on a terminal, and in a log file (no terminal) one line every
``1 / PROGRESS_LINES`` of the total instead of a carriage-return redraw per update.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

PROGRESS_LINES = 20  # without a terminal: a line every 5% of the total (and the last)


def flag_value(value) -> str:
    """``value`` as ml-collections parses it from ``--config.KEY=VALUE``: sequences as
    tuples (``(0, 1)``), the empty string as ``''``, anything else as ``str``."""
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):
        return repr(tuple(value))
    return str(value)


def duration(seconds: float) -> str:
    """``1h02m03s``, or ``2m03s`` under an hour."""
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{s:02d}s" if hours else f"{minutes}m{s:02d}s"


class _Lines:
    """tqdm's output stream in a log file: each bar it draws is a line of its own (the
    carriage returns a terminal redraws after are dropped, and so are blank writes)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class _LoggedProgress(tqdm):
    """tqdm that draws only when its count reaches a new ``1 / PROGRESS_LINES`` of the
    total, or the total; postfix changes and timed refreshes in between draw nothing."""

    _drawn = None  # (the count, its fraction of PROGRESS_LINES) last drawn

    def display(self, msg=None, pos=None):
        if msg is not None:  # tqdm clearing its line: nothing to clear in a file
            return True
        mark = self.n * PROGRESS_LINES // self.total if self.total else self.n
        if self._drawn is not None and (
            self.n == self._drawn[0] or (mark == self._drawn[1] and self.n != self.total)
        ):
            return True
        self._drawn = (self.n, mark)
        return super().display(msg, pos)


def progress(stream=None, **kwargs) -> tqdm:
    """A tqdm progress bar on ``stream`` (default standard error): tqdm's own where the
    stream is a terminal, else a line every ``1 / PROGRESS_LINES`` of the total."""
    stream = sys.stderr if stream is None else stream
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(file=stream, dynamic_ncols=True, **kwargs)
    return _LoggedProgress(file=_Lines(stream), ncols=100, **kwargs)
