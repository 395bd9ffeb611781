"""sagm_jax.sharpness_curves on a real tiny run: restored checkpoint, target domain, figure."""

import functools
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
    run's last and averaged models, both in one call (``--checkpoint latest,swad``)."""
    config = digits_config(
        steps=3, cnn_widths=(8, 16, 16, 16), test_envs=(2,), swad=True, swad_eval_every=1,
    )
    run_dir = tmp_path / "sweep" / "run0"
    train.train_and_evaluate(config, str(run_dir))
    rhos, out = [0.0, 0.05, 0.5], tmp_path / "out"
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
                "latest,swad",
            ]
        )
        == 0
    )
    with open(out / "sharpness.json") as f:
        entries = json.load(f)
    assert [e["checkpoint"] for e in entries] == ["latest", "swad"]
    assert os.path.getsize(out / "sharpness.png") > 10_000
    for entry in entries:
        check_the_curve(run_dir, entry)


@functools.partial(jax.jit, static_argnums=0)
def loss_and_sharpness(model, params, images, labels, rho):
    """Full-batch loss of ``images`` at w, and h_rho = L(w + rho g/|g|) - L(w)."""

    def loss(params):
        logits = model.apply({"params": params}, images, train=False)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    clean, g = jax.value_and_grad(loss)(params)
    norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g)))
    shifted = jax.tree.map(lambda w, x: w + rho * x / norm, params, g)
    return clean, loss(shifted) - clean


def check_the_curve(run_dir, entry):
    """The script's curve of the checkpoint ``entry`` names against the loss computed here."""
    checkpoint = entry["checkpoint"]
    assert entry["test_env"] == 2 and entry["env_name"] == "30" and entry["step"] == 2
    assert entry["method"] == ("SAGM + SWAD" if checkpoint == "swad" else "SAGM")
    assert entry["sharpness"][0] == 0.0

    # Independently: full-batch loss of the whole target domain at w and at w + rho g/|g|.
    _, dataset, model, variables, step = sharpness_curves.restore_run(str(run_dir), checkpoint)
    params = jax.device_get(variables["params"])  # as NumPy: one compilation for both models
    assert step == 2
    env = 2
    images = np.asarray(dataset.source.images[env], np.float32)
    labels = np.asarray(dataset.source.labels[env], np.int32)

    clean, h = loss_and_sharpness(model, params, images, labels, 0.5)
    np.testing.assert_allclose(entry["loss"], float(clean), rtol=1e-5)
    np.testing.assert_allclose(entry["sharpness"][2], float(h), rtol=1e-3, atol=1e-5)
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


def test_an_unknown_checkpoint_is_a_usage_error(tmp_path, capsys):
    argv = ["--input_dir", str(tmp_path), "--output_dir", str(tmp_path), "--checkpoint"]
    with pytest.raises(SystemExit) as exit_:
        sharpness_curves.main([*argv, "latest,last"])
    assert exit_.value.code == 2
    assert "--checkpoint 'latest,last': expected latest, best or swad" in capsys.readouterr().err
