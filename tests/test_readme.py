"""The README's examples (and the load_run example of docs/training.md) run as written,
its links and the docs' lead somewhere, its layout table names the package as it is, and
it stays short (the depth lives in docs/)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
README_MAX_LINES = 350
PAGES = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]


def read(path):
    with open(path) as f:
        return f.read()


def test_optimizer_example_runs():
    text = read(README)
    start = text.index("\n## Optimizers\n")
    section = text[start : text.index("\n## ", start + 1)]
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace = {}
    exec(compile(example, "README.md:Optimizers", "exec"), namespace)
    assert int(namespace["state"][0].count) == 3
    assert float(abs(namespace["params"]["w"]).sum()) > 0


def anchors(path):
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation
    dropped, spaces as hyphens)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", read(path), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_links_stay_inside_the_repository(page):
    """A clone has no ../shared: every relative link of the README and of the docs
    points to a file of the repository, and to a heading of it where it names one."""
    text = read(page)
    assert "../shared" not in text
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        assert path.startswith(ROOT + os.sep) and os.path.exists(path), target
        if anchor and path.endswith(".md"):
            assert anchor in anchors(path), f"{target}#{anchor}"


def test_readme_stays_short():
    """The README is the tour; the depth lives in docs/."""
    assert len(read(README).splitlines()) <= README_MAX_LINES


def test_layout_table_names_the_package_as_it_is():
    """Every path the Layout table names exists, and every module and subpackage of
    sagm_jax has its row."""
    text = read(README)
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    table = text[start : end if end != -1 else len(text)]
    named = set(re.findall(r"`((?:sagm_jax|configs|experiments|tests|docs)/[^`]*)`", table))
    for path in named:
        assert os.path.exists(os.path.join(ROOT, path)), path
    package = os.path.join(ROOT, "sagm_jax")
    for entry in sorted(os.listdir(package)):
        if entry.endswith(".py") and entry != "__init__.py":
            assert f"sagm_jax/{entry}" in named, f"sagm_jax/{entry} has no row"
        elif os.path.exists(os.path.join(package, entry, "__init__.py")):
            assert f"sagm_jax/{entry}/" in named, f"sagm_jax/{entry}/ has no row"


# docs/training.md's load_run example runs on a trained run in
# tests/training/test_loading.py::test_load_run_gives_the_selected_checkpoint_and_its_recorded_accuracy.
