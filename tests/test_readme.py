"""The README's optimizer example runs as written."""

import os
import re

import pytest

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


@pytest.mark.slow
def test_load_run_example_runs_on_a_trained_run(tmp_path):
    """The README's inference example, on a real (tiny) RotatedDigits run."""
    from sagm_jax import train
    from sagm_jax.config import mnist_config

    config = mnist_config("RotatedDigits")
    config.update(dict(batch_per_env=8, steps=2, eval_every=1, cnn_widths=(8, 8, 8, 8)))
    records = train.train_and_evaluate(config, str(tmp_path / "run"))
    with open(README) as f:
        text = f.read()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "load_run" in b]
    example = example.replace('"workdirs/my-run"', repr(str(tmp_path / "run")))
    namespace = {}
    exec(compile(example, "README.md:load_run", "exec"), namespace)
    assert namespace["record"] == train.read_records(str(tmp_path / "run"))[namespace["record"]["step"]]
    assert len(records) == 2
    assert namespace["predicted_class"].shape == (4,)
