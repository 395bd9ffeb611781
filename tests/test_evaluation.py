"""sagm_jax.evaluation: the evaluator's accuracy of every split part is a count over
every example exactly once, checked against NumPy on the dataset's own arrays.

RotatedDigits on the eight fake CPU devices, evaluation batch 64: each 'in' part
(240 or 239 examples) ends in an uneven batch and each 'out' part (60 or 59) is one
padded batch, so a padded row counted, or an uneven batch dropped, changes the count.
"""

import types

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from sagm_jax import data as data_lib
from sagm_jax.config import mnist_config
from sagm_jax.data import mnist
from sagm_jax.evaluation import Evaluator


class Linear(nn.Module):
    """A linear classifier of the flattened image."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def digits_config(**overrides):
    config = mnist_config("RotatedDigits")
    config.update(dict(eval_batch_size=64, test_envs=(0,)))
    config.update(overrides)
    return config


def numpy_accuracy_and_loss(params, images, labels) -> tuple[float, float]:
    """argmax == label over every example, and the mean cross-entropy per example, the
    logits computed in float64 by NumPy."""
    kernel, bias = (np.asarray(params["Dense_0"][k], np.float64) for k in ("kernel", "bias"))
    logits = images.reshape(len(images), -1).astype(np.float64) @ kernel + bias
    shifted = logits - logits.max(1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    loss = -np.mean(log_probs[np.arange(len(labels)), labels])
    return int(np.sum(np.argmax(logits, -1) == labels)) / len(labels), loss


@pytest.mark.parametrize(
    "split,parts", [("domainbed", {"in", "out"}), ("in_domain", {"in", "out", "test"})]
)
def test_accuracy_of_every_part_counts_every_example_once(split, parts):
    config = digits_config(split=split)
    dataset = data_lib.from_config(config)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    assert mesh.devices.size == 8 and config.eval_batch_size % 8 == 0
    model = Linear()
    params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 1), np.float32))["params"]
    evaluator = Evaluator(model, dataset, mesh, config, train_envs=[1, 2, 3, 4, 5])
    accuracies = evaluator(types.SimpleNamespace(params=params, batch_stats={}))

    source = mnist.rotated_digits(None, config.seed)
    expected = {}
    for env in range(6):
        for part, indices in dataset.splits[env].items():
            assert len(indices) % config.eval_batch_size != 0  # an uneven last batch
            images, labels = source.images[env][indices], source.labels[env][indices]
            accuracy, loss = numpy_accuracy_and_loss(params, images, labels)
            expected[f"env{env}_{part}_acc"] = accuracy
            assert accuracies.pop(f"env{env}_{part}_loss") == pytest.approx(loss, rel=1e-5)
    assert {k.split("_")[1] for k in accuracies} == parts
    assert accuracies == expected
    # A random linear model is not at chance everywhere alike: the parts differ.
    assert len(set(accuracies.values())) > 1


def test_an_empty_split_part_is_refused_when_the_evaluator_is_built():
    config = digits_config(holdout_fraction=0.001)  # int(300 * 0.001) = 0 'out' examples
    dataset = data_lib.from_config(config)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match=r"Empty split parts: env0 \(0\) 'out'"):
        Evaluator(Linear(), dataset, mesh, config, train_envs=[1, 2, 3, 4, 5])
