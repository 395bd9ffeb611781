"""Reading a finished run back: its model, weights and the inputs it expects.

``load_run(workdir, which)`` gives a run's Flax model, the variables of a kept
checkpoint (or of SWAD's averaged model) and that step's record; ``preprocess(workdir,
images)`` prepares a user's images as the run's evaluation prepared its own. Both read
only the run directory (``rundir``'s files and ``checkpoints``); nothing of the
optimizer is rebuilt.
"""

from __future__ import annotations

import os

import jax
import ml_collections
import numpy as np

from sagm_jax.methods import networks
from sagm_jax.data import device_augment, registry
from sagm_jax.results.selection import training_domain_validation
from sagm_jax.training.checkpoints import restore_swad_variables, restore_variables, saved_steps
from sagm_jax.training.rundir import read_config, read_records, read_run_info, read_swad_record

__all__ = ["load_run", "preprocess"]


def load_run(workdir: str, which: str | int = "best"):
    """A trained run, for inference or analysis: ``(model, variables, record)``.

    ``which``: ``"best"`` (the step training-domain validation selects, as the summary
    and the tables do), ``"latest"``, a step number of a kept checkpoint, or ``"swad"``
    (a SWAD run's averaged model, with its swad.jsonl record). A run with
    ``config.moving_average`` predicts with its moving average: every ``which`` gives the
    average's variables at that step (its records are the average's, and say so), and
    ``"moving_average"`` is its best step's, refused for a run without one. ``model``
    is the Flax module, ``variables`` its ``{'params', 'batch_stats'}``; apply it as
    ``model.apply(variables, images_nhwc, train=False)`` to images prepared as the run's
    evaluation prepares them. ``record`` is the results.jsonl record of that step. A
    prediction that depends on the evaluated batch (ARM, MTL) reproduces the record in
    batches of ``record["eval_batch_size"]`` (the reference's 64 unless the run set it),
    each with ``mask=`` (its real rows) and, for MTL's noise,
    ``key=evaluation.batch_key(seed, env, part, index)``.
    Nothing of the optimizer is rebuilt, so any run (any algorithm, per-device
    perturbation included) loads the same way.
    """
    config = ml_collections.ConfigDict(read_config(workdir))
    info = read_run_info(workdir)
    records = read_records(workdir)
    if which == "swad":
        return _model(config, info), restore_swad_variables(workdir), read_swad_record(workdir)
    if which == "moving_average":
        if not config.get("moving_average"):
            raise ValueError(
                f"{workdir}: load_run(which='moving_average'): the run kept no moving "
                "average (config.moving_average=False); 'best', 'latest' or a step gives its "
                "weights."
            )
        which = "best"
    if which == "best":
        step = training_domain_validation(records, config.test_envs)["step"]
    elif which == "latest":
        step = max(saved_steps(workdir), default=None)
    else:
        step = int(which)
    if step is None:
        raise FileNotFoundError(f"{workdir} holds no checkpoint.")
    model = _model(config, info)
    record = next((r for r in records if r["step"] == step), None)
    return model, restore_variables(workdir, step), record


def _model(config, info):
    """The run's network (with its method's prediction, ``methods.networks``)."""
    return networks.from_config(
        config, info["num_classes"], info["input_shape"], len(info["train_envs"]),
        jax.random.key(0), pretrained=False,
        imagenet_inputs=registry.get_spec(info["dataset"]).kind == "folder",
    )[0]


def preprocess(workdir: str, images) -> np.ndarray:
    """``images`` as the run's evaluation prepares them: the float32 batch
    ``model.apply(variables, batch, train=False)`` takes (``load_run``).

    Image-folder runs take PIL images, image files or uint8 RGB arrays ``[H, W, 3]`` of
    any size (a list, or one array ``[N, H, W, 3]``): each is resized whole to the run's
    input size (``run_info.json``'s ``input_shape``, from ``config.image_size``) with
    PIL's bilinear resize, as the run's evaluation images were, then scaled to [0, 1]
    and normalised with ImageNet's mean and std. MNIST-like runs take arrays of their
    input shape, float in [0, 1] as the dataset stores them, or uint8 (scaled by 1/255).
    """
    info = read_run_info(workdir)
    shape = tuple(info["input_shape"])
    if registry.get_spec(info["dataset"]).kind == "folder":
        batch = np.stack([_evaluation_image(image, shape[0]) for image in images])
        batch = batch.astype(np.float32) / 255.0
        mean = np.asarray(device_augment.IMAGENET_MEAN, np.float32)
        return (batch - mean) / np.asarray(device_augment.IMAGENET_STD, np.float32)
    batch = np.asarray(images)
    if batch.shape[1:] != shape:
        raise ValueError(
            f"{workdir} was trained on {info['dataset']} images of shape {shape}; "
            f"got a batch of shape {batch.shape}."
        )
    return batch.astype(np.float32) / (255.0 if batch.dtype == np.uint8 else 1.0)


def _evaluation_image(image, size: int) -> np.ndarray:
    """uint8 ``[size, size, 3]``: an image folder's evaluation image (``data.store``)."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as opened:
            image = opened.convert("RGB")
    elif not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, np.uint8)).convert("RGB")
    return np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR))
