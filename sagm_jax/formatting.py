"""How values and durations are written for people: one form each, everywhere.

``flag_value`` is a config value as ``--config.KEY=`` takes it back (the command line,
the sweep's job commands, the config's error messages); ``duration`` is a wall time
(the run's "Wall time", the sweep's progress and ETA).
"""

from __future__ import annotations


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
