"""No citation of a file the repository does not hold, and no issue numbers.

Docstrings, comments, tests and docs cite the reference code (a repository, file, class
or function) or the project's own ``docs/`` pages. This test reads every tracked
``.py``, ``.md`` and ``.toml`` file under ``sagm_jax/``, ``tests/``, ``docs/``,
``experiments/`` and ``configs/``, and ``README.md``, and fails on a mention of a
document kept outside the repository or of an issue number. It leaves out its own file,
which holds the patterns.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("sagm_jax", "tests", "docs", "experiments", "configs")
SUFFIXES = (".py", ".md", ".toml")
OUTSIDE_DOCUMENTS = ("dg-algorithms.md", "sagm-spec.md", "domainbed-protocol.md")
ISSUE_NUMBER = re.compile(r"\bissue \d+", re.IGNORECASE)
THIS_FILE = os.path.relpath(os.path.abspath(__file__), ROOT)


def checked_files() -> list[str]:
    """The tracked files the rule covers, repository-relative; this file left out."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--", *FOLDERS, "README.md"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return sorted(
        path for path in listed
        if path.endswith(SUFFIXES) and path != THIS_FILE.replace(os.sep, "/")
        and os.path.isfile(os.path.join(ROOT, path))
    )


def citations(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line that cites an outside document or an issue."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if ISSUE_NUMBER.search(line) or any(name in line for name in OUTSIDE_DOCUMENTS)
    ]


def test_the_pattern_finds_what_it_should():
    assert citations("see issue 17\nIssue 21, item 3\nno issues here") == [
        (1, "see issue 17"), (2, "Issue 21, item 3"),
    ]
    assert citations("as dg-algorithms.md says\nsagm-spec.md\ndomainbed-protocol.md") == [
        (1, "as dg-algorithms.md says"), (2, "sagm-spec.md"), (3, "domainbed-protocol.md"),
    ]
    assert citations("the tissue 4 and reissue 5 are words, not issues") == []


def cited_lines(paths: list[str]) -> list[str]:
    """``path:line: text`` of every citation in ``paths``."""
    found = []
    for path in paths:
        with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
            found += [f"{path}:{number}: {line}" for number, line in citations(handle.read())]
    return found


def test_no_package_test_doc_or_experiment_file_cites_an_outside_document_or_an_issue():
    found = cited_lines([path for path in checked_files() if path != "README.md"])
    assert not found, "citations of outside documents or issue numbers:\n" + "\n".join(found)


def test_the_readme_cites_no_outside_document_and_no_issue_number():
    found = cited_lines([path for path in checked_files() if path == "README.md"])
    assert not found, "citations of outside documents or issue numbers:\n" + "\n".join(found)
