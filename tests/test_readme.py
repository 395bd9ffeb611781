"""The README's optimizer example runs as written."""

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_optimizer_example_runs():
    with open(README) as f:
        text = f.read()
    section = text[text.index("## Optimizers") : text.index("### Cost per step")]
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace = {}
    exec(compile(example, "README.md:Optimizers", "exec"), namespace)
    assert int(namespace["state"][0].count) == 3
    assert float(abs(namespace["params"]["w"]).sum()) > 0


def test_links_stay_inside_the_repository():
    """A clone has no ../shared: every relative link of the README points into it."""
    with open(README) as f:
        text = f.read()
    assert "../shared" not in text
    root = os.path.dirname(README)
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if not target.startswith(("http://", "https://")):
            assert os.path.exists(os.path.join(root, target)), target
