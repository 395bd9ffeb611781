"""sagm_jax.training.loading: a finished run read back (``load_run``: the selected
checkpoint reproduces its record) and a user's images prepared as the run's evaluation
prepared its own (``preprocess``)."""

import os
import re

import jax
import numpy as np
import pytest
from PIL import Image

from sagm_jax.data import decode, device_augment
from sagm_jax.training import loading
from sagm_jax.training import rundir
from sagm_jax.training import train

from run_fixtures import digits_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_load_run_gives_the_selected_checkpoint_and_its_recorded_accuracy(tmp_path):
    """Checkpoints are numbered by record steps, "best" is the step the summary selects,
    and the loaded model reproduces that record's accuracy, counted here directly; the
    docs' inference example runs on the same run."""
    from sagm_jax import data as data_lib
    from sagm_jax.results.selection import training_domain_validation

    config = digits_config(steps=7, eval_every=2, lr=3e-3)
    records = train.train_and_evaluate(config, str(tmp_path))
    selected = training_domain_validation(records, [0])["step"]
    model, variables, record = loading.load_run(str(tmp_path), "best")
    assert record["step"] == selected
    assert loading.load_run(str(tmp_path), "latest")[2]["step"] == 6
    dataset = data_lib.load("RotatedDigits", None, trial_seed=0, data_seed=0)
    assert "env1_in_acc" not in record  # eval_splits="fast": a training env's 'in'
    # Compiled, and on one device: eagerly, op by op, on the eight devices the variables
    # are restored to (replicated: each ran the whole part), the three parts took seconds.
    apply = jax.jit(lambda v, x: model.apply(v, x, train=False))
    variables = jax.device_get(variables)
    for env, part in ((0, "in"), (0, "out"), (1, "out")):
        k = dataset.splits[env][part]
        images = dataset.source.images[env][k]
        logits = apply(variables, np.asarray(images, np.float32))
        correct = int(np.sum(np.asarray(np.argmax(logits, -1)) == dataset.source.labels[env][k]))
        assert correct / len(k) == record[f"env{env}_{part}_acc"]
    # docs/training.md's inference example, on this run.
    with open(os.path.join(REPO, "docs", "training.md")) as f:
        text = f.read()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "load_run" in b]
    namespace = {}
    example = example.replace('"workdirs/my-run"', repr(str(tmp_path)))
    exec(compile(example, "docs/training.md:load_run", "exec"), namespace)
    recorded = {r["step"]: r for r in train.read_records(str(tmp_path))}
    assert namespace["record"] == recorded[namespace["record"]["step"]]
    assert namespace["predicted_class"].shape == (4,)


# ---- preprocess: a user's images become the batch the run's evaluation gives its model


def write_run_info_of(folder, dataset, input_shape):
    os.makedirs(folder)
    info = {"dataset": dataset, "input_shape": input_shape, "class_names": ["a", "b"]}
    rundir.write_json(os.path.join(folder, rundir.RUN_INFO), info)
    return str(folder)


def test_folder_images_are_resized_to_the_runs_input_and_normalised(tmp_path):
    workdir = write_run_info_of(tmp_path / "run", "PACS", [32, 32, 3])
    pixels = np.random.default_rng(0).integers(0, 256, (45, 70, 3), dtype=np.uint8)
    path = str(tmp_path / "image.png")
    Image.fromarray(pixels).save(path)
    # What the run evaluated: the store's evaluation image, normalised on the device.
    stored = decode.decode_file(path, (45, 70), (45, 70), 32)[1]
    expected = np.asarray(device_augment.normalize(stored.astype(np.float32) / 255.0))
    with Image.open(path) as opened:
        batch = loading.preprocess(workdir, [path, pixels, opened])  # a file, an array, PIL's
    assert batch.shape == (3, 32, 32, 3) and batch.dtype == np.float32
    for image in batch:
        np.testing.assert_allclose(image, expected, atol=1e-5)


def test_mnist_like_images_keep_their_shape_and_scale(tmp_path):
    workdir = write_run_info_of(tmp_path / "run", "RotatedDigits", [28, 28, 1])
    digits = np.random.default_rng(1).integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
    np.testing.assert_allclose(loading.preprocess(workdir, digits), digits / 255.0, rtol=1e-6)
    as_stored = digits.astype(np.float32) / 255.0
    np.testing.assert_array_equal(loading.preprocess(workdir, as_stored), as_stored)
    with pytest.raises(ValueError, match=r"shape \(28, 28, 1\); got a batch of shape"):
        loading.preprocess(workdir, np.zeros((2, 32, 32, 3), np.uint8))
