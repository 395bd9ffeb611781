"""sagm_jax.sharpness_curves on a real tiny run: restored checkpoint, target domain, figure."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sagm_jax.results import sharpness_curves
from sagm_jax.training import train

from run_fixtures import digits_config


@pytest.mark.slow
def test_sharpness_curves_of_a_finished_run(tmp_path):
    """The script restores the parameters without rebuilding the optimizer (so per-device
    runs load as global ones do: tests/training/test_train.py restores one); a SWAD
    run's last and averaged models."""
    config = digits_config(
        steps=3, cnn_widths=(8, 16, 16, 16), test_envs=(2,), swad=True, swad_eval_every=1,
        num_devices=1,
    )
    run_dir = tmp_path / "sweep" / "run0"
    train.train_and_evaluate(config, str(run_dir))
    for checkpoint in ("latest", "swad"):
        check_the_curve(tmp_path, run_dir, checkpoint)


def check_the_curve(tmp_path, run_dir, checkpoint):
    """The script's curve of ``checkpoint`` against the loss computed here."""
    rhos, out = [0.0, 0.05, 0.5], tmp_path / f"out_{checkpoint}"
    assert (
        sharpness_curves.main(
            [
                "--input_dir",
                str(tmp_path / "sweep"),
                "--output_dir",
                str(out),
                "--rhos",
                ",".join(map(str, rhos)),
                "--checkpoint",
                checkpoint,
            ]
        )
        == 0
    )
    with open(out / "sharpness.json") as f:
        (entry,) = json.load(f)
    assert entry["test_env"] == 2 and entry["env_name"] == "30" and entry["step"] == 2
    assert entry["method"] == ("SAGM + SWAD" if checkpoint == "swad" else "SAGM")
    assert entry["sharpness"][0] == 0.0
    assert os.path.getsize(out / "sharpness.png") > 10_000

    # Independently: full-batch loss of the whole target domain at w and at w + rho g/|g|.
    _, dataset, model, variables, step = sharpness_curves.restore_run(str(run_dir), checkpoint)
    params = variables["params"]
    assert step == 2
    env = 2
    images = np.asarray(dataset.source.images[env], np.float32)
    labels = np.asarray(dataset.source.labels[env], np.int32)

    def loss(params):
        logits = model.apply({"params": params}, images, train=False)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    clean, g = jax.value_and_grad(loss)(params)
    norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g)))
    shifted = jax.tree.map(lambda w, x: w + 0.5 * x / norm, params, g)
    np.testing.assert_allclose(entry["loss"], float(clean), rtol=1e-5)
    np.testing.assert_allclose(
        entry["sharpness"][2], float(loss(shifted) - clean), rtol=1e-3, atol=1e-5
    )
    assert entry["sharpness"][2] > entry["sharpness"][1] > 0


def test_only_finished_runs_are_measured(tmp_path):
    for name, files in (("done", ("config.json", "done")), ("running", ("config.json",))):
        os.makedirs(tmp_path / name)
        for file in files:
            (tmp_path / name / file).write_text("{}")
    assert sharpness_curves.finished_runs(str(tmp_path)) == [str(tmp_path / "done")]
    with pytest.raises(FileNotFoundError, match="No finished run"):
        sharpness_curves.finished_runs(str(tmp_path / "running"))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        sharpness_curves.finished_runs(str(tmp_path / "nowhere"))
