"""sagm_jax.formatting: durations, and the progress bar in a log file."""

import io

from sagm_jax import formatting


def test_duration_under_and_over_an_hour():
    assert formatting.duration(59.6) == "1m00s"
    assert formatting.duration(3723) == "1h02m03s"


def test_progress_without_a_terminal_is_a_line_every_5_percent():
    """A log file gets whole lines, one per 1/20 of the total and the last, however
    often the bar is updated or its postfix changes (not a redraw per update)."""
    log = io.StringIO()
    bar = formatting.progress(log, total=301, unit="step", mininterval=0)
    for t in range(301):
        bar.update(1)
        if t % 10 == 0:
            bar.set_postfix(loss=f"{1 / (t + 1):.4f}")
    bar.close()
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and all(lines)
    assert 20 <= len(lines) <= formatting.PROGRESS_LINES + 1, lines
    percents = [int(line.split("%")[0]) for line in lines]
    assert percents == sorted(percents) and percents[-1] == 100
    assert "301/301" in lines[-1]


def test_progress_on_a_terminal_is_tqdms_redrawn_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    bar = formatting.progress(screen, total=10, mininterval=0)
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert screen.getvalue().count("\r") >= 10
