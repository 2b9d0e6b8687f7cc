"""docs/settings.md lists every ``PACER_*`` setting, and nothing the code no longer has.

A setting is found the simple way: every ``PACER_*`` token in ``libs/``,
``services/`` and ``docker/`` (reads, docstrings, comments: a setting is
rarely read where it is never named) and every ``PACER_*`` variable a
manifest in ``deploy/`` sets.  A token ending in ``_`` is a family prefix
(``f"PACER_METRICS_PORT_{service}"``, ``PACER_BRAIN_*`` in a docstring).  A
setting is documented when it is the first cell of a table row of the page,
or matches a pattern row such as ``PACER_METRICS_PORT_<SERVICE>``.  The
standard ``OTEL_*`` variables Pacer reads itself (``env.get("OTEL_...")``)
must have rows too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "settings.md"
READ_DIRS = ("libs", "services", "docker")  # what a user's setting must be documented from
# Where a documented name may still live: the readers, plus the tests (PACER_CHROMIUM...).
EXISTS_DIRS = (*READ_DIRS, "tests")
SKIP_PARTS = {"__pycache__", ".egg-info", "node_modules"}

# PACER_* names in the code that are not environment variables (kept out of the page's tables).
NOT_SETTINGS = {
    "PACER_EVENTS": "the events stream (pacer.subjects.EVENTS_STREAM)",
    "PACER_SHARDLOG": "the shard-log stream (pacer.subjects.SHARD_LOG_STREAM)",
}

TOKEN = re.compile(r"\bPACER_[A-Z0-9_]+")
ROW = re.compile(r"^\|\s*`((?:PACER|OTEL)_[A-Za-z0-9_<>]+)`", re.MULTILINE)
# A container's ``env`` entry (``- name: PACER_X``) or a ConfigMap key read through ``envFrom`` (``PACER_X: v``).
DEPLOY_ENV = re.compile(r"""^\s*(?:-\s+name:\s*["']?(PACER_[A-Z0-9_]+)|(PACER_[A-Z0-9_]+):\s)""", re.MULTILINE)
OTEL_READ = re.compile(r"""(?:environ|env)\.get\(\s*["'](OTEL_[A-Z0-9_]+)["']""")


def _files(dirs: Iterable[Path]) -> Iterable[Path]:
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file() and not (SKIP_PARTS & set(p.parts)) and not any(s.endswith(".egg-info") for s in p.parts):
                yield p


def _text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def tokens(dirs: Iterable[Path], skip: Path | None = None) -> dict[str, str]:
    """``PACER_*`` token -> the first ``file:line`` naming it."""
    out: dict[str, str] = {}
    for p in _files(dirs):
        if skip is not None and p.resolve() == skip:
            continue
        for n, line in enumerate(_text(p).splitlines(), 1):
            for t in TOKEN.findall(line):
                out.setdefault(t, f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}:{n}")
    return out


def documented(doc: str) -> tuple[set[str], list[re.Pattern[str]]]:
    """The names of the page's table rows, and its pattern rows as regexes (``<X>`` = any suffix)."""
    names, patterns = set(), []
    for cell in ROW.findall(doc):
        if "<" in cell:
            patterns.append(re.compile(re.sub(r"<[^>]+>", "[A-Z0-9_]+", cell)))
        else:
            names.add(cell)
    return names, patterns


def undocumented(found: Iterable[str], doc: str) -> list[str]:
    """The settings in ``found`` that the page has no row for (``NOT_SETTINGS`` left out)."""
    names, patterns = documented(doc)
    missing = []
    for t in sorted(set(found) - set(NOT_SETTINGS)):
        if t.endswith("_"):  # a family: some row (or pattern row) must be of it
            ok = any(n.startswith(t) for n in names) or any(p.pattern.startswith(t) for p in patterns)
        else:
            ok = t in names or any(p.fullmatch(t) for p in patterns)
        if not ok:
            missing.append(t)
    return missing


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_pacer_name_in_the_code_is_documented_or_a_known_non_setting() -> None:
    found = tokens(ROOT / d for d in READ_DIRS)
    missing = undocumented(found, _doc())
    assert not missing, "PACER_* names with no row in docs/settings.md (document them, or add a name that is " \
        "not a setting to NOT_SETTINGS): " + ", ".join(f"{t} ({found[t]})" for t in missing)


def test_every_variable_the_manifests_set_is_documented() -> None:
    found = {a or b: str(p.relative_to(ROOT)) for p in _files([ROOT / "deploy"]) if p.suffix in (".yaml", ".yml")
             for a, b in DEPLOY_ENV.findall(_text(p))}
    assert "PACER_NATS_URL" in found  # the scan sees the manifests at all
    missing = undocumented(found, _doc())
    assert not missing, "set in deploy/ but not in docs/settings.md: " + ", ".join(
        f"{t} ({found[t]})" for t in missing)


def test_no_stale_rows() -> None:
    """Each row's name (each pattern row's prefix) is still named somewhere in the code."""
    here = Path(__file__).resolve()
    names, patterns = documented(_doc())
    code = tokens((ROOT / d for d in EXISTS_DIRS), skip=here)
    pacer_names = {n for n in names if n.startswith("PACER_")}
    stale = sorted(n for n in pacer_names if n not in code)
    stale += [p.pattern for p in patterns
              if not any(t.startswith(p.pattern.split("[", 1)[0]) for t in code)]
    assert not stale, f"docs/settings.md documents names the code no longer has: {stale}"
    assert not pacer_names & set(NOT_SETTINGS), "a name listed as not a setting has a settings row"


def test_not_settings_allowlist_is_current() -> None:
    code = tokens(ROOT / d for d in READ_DIRS)
    assert not set(NOT_SETTINGS) - set(code), "NOT_SETTINGS names something the code no longer has"


def test_the_otel_variables_pacer_reads_have_rows_and_no_others() -> None:
    read = {m for p in _files(ROOT / d for d in READ_DIRS) if p.suffix == ".py" for m in OTEL_READ.findall(_text(p))}
    assert "OTEL_SERVICE_NAME" in read  # the scan sees the reads at all
    rows = {n for n in documented(_doc())[0] if n.startswith("OTEL_")}
    assert read - rows == set(), f"OTEL_* variables read in the code with no row: {sorted(read - rows)}"
    assert rows - read == set(), f"OTEL_* rows for variables Pacer does not read itself: {sorted(rows - read)}"


def test_the_check_fails_on_an_undocumented_setting(tmp_path: Path) -> None:
    """The checker itself: a new read is reported, a documented family member and a non-setting are not."""
    (tmp_path / "svc.py").write_text(
        'import os\n'
        'a = os.environ.get("PACER_SOMETHING_NEW", "1")\n'
        'b = os.environ.get("PACER_METRICS_PORT_NEWSERVICE")\n'
        'c = f"PACER_UNKNOWN_FAMILY_{1}"\n'
        f'STREAM = "{next(iter(NOT_SETTINGS))}"\n')
    found = tokens([tmp_path])
    assert undocumented(found, _doc()) == ["PACER_SOMETHING_NEW", "PACER_UNKNOWN_FAMILY_"]
    assert undocumented(found, _doc() + "\n| `PACER_SOMETHING_NEW` | x |\n| `PACER_UNKNOWN_FAMILY_<X>` | y |\n") == []
