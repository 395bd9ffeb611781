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
