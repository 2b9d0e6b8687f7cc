"""A failed local worker's error shows the end of its log (what CI prints when a TF test fails)."""
from __future__ import annotations

from pathlib import Path

from pacer.trainer.local import log_tail


def test_the_tail_is_the_last_lines_even_of_a_long_log(tmp_path: Path) -> None:
    f = tmp_path / "worker-0.log"
    f.write_text("".join(f"line {i} {'x' * 100}\n" for i in range(1000)) + "Traceback: boom\n")
    tail = log_tail(f, lines=3).splitlines()
    assert tail[-1] == "Traceback: boom" and tail[0].startswith("line 998 ") and len(tail) == 3


def test_a_missing_or_undecodable_log_gives_what_it_can(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "absent.log") == ""
    f = tmp_path / "bin.log"
    f.write_bytes(b"\xff\xfe bad bytes\nlast line\n")
    assert log_tail(f).splitlines()[-1] == "last line"
