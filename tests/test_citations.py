"""No citation of a file the repository does not hold, and no issue numbers.

Docstrings, comments, tests and docs cite the reference code (a repository, file, class
or function) or the project's own ``docs/`` pages. This test reads every tracked
``.py``, ``.md`` and ``.toml`` file under ``sagm_jax/``, ``tests/``, ``docs/``,
``experiments/`` and ``configs/``, and ``README.md``, and fails on a mention of a
document kept outside the repository or of an issue number. The patterns are assembled
from parts, so this file holds no citation itself and is checked like the others.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("sagm_jax", "tests", "docs", "experiments", "configs")
SUFFIXES = (".py", ".md", ".toml")
# The three documents kept beside the repository, never in it.
OUTSIDE_DOCUMENTS = tuple(
    f"{'-'.join(stem)}.md" for stem in (("dg", "algorithms"), ("sagm", "spec"),
                                         ("domainbed", "protocol"))
)
ISSUE = "issue"
ISSUE_NUMBER = re.compile(rf"\b{ISSUE} \d+", re.IGNORECASE)


def checked_files() -> list[str]:
    """The tracked files the rule covers, repository-relative."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--", *FOLDERS, "README.md"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return sorted(
        path for path in listed
        if path.endswith(SUFFIXES) and os.path.isfile(os.path.join(ROOT, path))
    )


def citations(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line that cites an outside document or an issue."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if ISSUE_NUMBER.search(line) or any(name in line for name in OUTSIDE_DOCUMENTS)
    ]


def test_the_pattern_finds_what_it_should():
    numbered = [f"see {ISSUE} {17}", f"{ISSUE.title()} {21}, item 3"]
    assert citations("\n".join([*numbered, f"no {ISSUE}s here"])) == [
        (1, numbered[0]), (2, numbered[1]),
    ]
    named = [f"as {OUTSIDE_DOCUMENTS[0]} says", *OUTSIDE_DOCUMENTS[1:]]
    assert OUTSIDE_DOCUMENTS[0].startswith("dg-") and len(OUTSIDE_DOCUMENTS) == 3
    assert citations("\n".join(named)) == [(1, named[0]), (2, named[1]), (3, named[2])]
    assert citations(f"the t{ISSUE} 4 and re{ISSUE} 5 are words, not {ISSUE}s") == []


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
