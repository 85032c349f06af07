"""Long work shows progress: a redrawn bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from tools.cli.common import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_at_most_every_interval_and_a_last_line() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress("restore 7", 4_000_000, out, clock=lambda: now[0], line_s=5.0)
    p.advance(1_000_000)  # no time has passed: nothing yet
    now[0] = 5.0
    p.advance(1_000_000)
    now[0] = 6.0
    p.advance(1_000_000)  # within 5 s of the last line
    p.advance(1_000_000)
    p.finish()
    lines = out.getvalue().splitlines()
    assert lines == ["restore 7:  50.0% (2.0 of 4.0 MB)", "restore 7: 100.0% (4.0 of 4.0 MB)"]


def test_short_work_prints_nothing() -> None:
    out = io.StringIO()
    p = Progress("verify", 10, out, clock=lambda: 0.0)
    p.advance(10)
    p.finish()
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_redrawn_in_place() -> None:
    now = [0.0]
    out = Tty()
    p = Progress("export", 100, out, clock=lambda: now[0])
    for _ in range(4):
        now[0] += 0.2
        p.advance(25)
    p.finish()
    text = out.getvalue()
    assert text.count("\r") == 5 and text.endswith("100.0%\n") and "#" * 30 in text


def test_quiet_prints_nothing() -> None:
    now = [0.0]
    out = Tty()
    p = Progress("export", 100, out, clock=lambda: now[0], enabled=False)
    now[0] = 100.0
    p.advance(100)
    p.finish()
    assert out.getvalue() == ""
