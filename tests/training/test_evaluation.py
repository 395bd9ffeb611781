"""sagm_jax.training.evaluation: the evaluator's accuracy of each split part it evaluates is a
count over every example exactly once, checked against NumPy on the dataset's own
arrays; ``eval_splits="fast"`` evaluates exactly the parts of the rule written out here
(SWAD's evaluator's), ``"all"`` every part, with equal accuracies where both evaluate.

RotatedDigits on the eight fake CPU devices, evaluation batch 64: each 'in' part
(240 or 239 examples) ends in an uneven batch and each 'out' part (60 or 59) is one
padded batch, so a padded row counted, or an uneven batch dropped, changes the count.
"""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from sagm_jax import data as data_lib
from sagm_jax.config import mnist_config
from sagm_jax.data import mnist
from sagm_jax.training.evaluation import Evaluator, evaluated_parts


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


def fast_keys(splits, test_envs):
    """What SWAD's evaluator (evalmode="fast", the SAGM authors') evaluates, written out
    here: the training environments' 'out' parts (and 'test' parts of the in-domain
    split), every part of the test environments; never a training environment's 'in'."""
    return {
        (env, part)
        for env, parts in enumerate(splits)
        for part in parts
        if env in test_envs or part in ("out", "test")
    }


@pytest.mark.parametrize("split", ["domainbed", "in_domain"])
def test_each_mode_counts_every_example_of_its_parts_once_and_the_modes_agree(split):
    dataset = data_lib.from_config(digits_config(split=split))
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    model = Linear()
    params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 1), np.float32))["params"]
    state = types.SimpleNamespace(params=params, batch_stats={})
    source = mnist.rotated_digits(None, digits_config().seed)
    every = {(env, part) for env in range(6) for part in dataset.splits[env]}
    parts = {"in", "out", "test"} if split == "in_domain" else {"in", "out"}
    assert {part for _, part in every} == parts
    results = {}
    for mode, wanted in (("all", every), ("fast", fast_keys(dataset.splits, {0}))):
        config = digits_config(split=split, eval_splits=mode)
        assert mesh.devices.size == 8 and config.eval_batch_size % 8 == 0
        evaluator = Evaluator(model, dataset, mesh, config, train_envs=[1, 2, 3, 4, 5])
        accuracies = evaluator(state)
        assert accuracies.pop("eval_batch_size") == config.eval_batch_size
        expected = {}
        for env, part in wanted:
            indices = dataset.splits[env][part]
            assert len(indices) % config.eval_batch_size != 0  # an uneven last batch
            images, labels = source.images[env][indices], source.labels[env][indices]
            accuracy, loss = numpy_accuracy_and_loss(params, images, labels)
            expected[f"env{env}_{part}_acc"] = accuracy
            assert accuracies.pop(f"env{env}_{part}_loss") == pytest.approx(loss, rel=1e-5)
        assert accuracies == expected  # exactly these parts: no other key
        results[mode] = accuracies
    # Fast mode leaves out the five training environments' 'in' parts and nothing else,
    # and the parts both modes evaluate have equal accuracies.
    assert set(results["all"]) - set(results["fast"]) == {f"env{e}_in_acc" for e in range(1, 6)}
    assert results["fast"] == {k: results["all"][k] for k in results["fast"]}
    # A random linear model is not at chance everywhere alike: the parts differ.
    assert len(set(results["all"].values())) > 1


DOMAINBED_PARTS = {"in": [0], "out": [1]}
IN_DOMAIN_PARTS = {"in": [0], "out": [1], "test": [2]}


@pytest.mark.parametrize(
    "parts,train_envs,fast",
    [
        # one test environment (0), DomainBed's split
        (
            DOMAINBED_PARTS,
            [1, 2, 3],
            [(0, "in"), (0, "out"), (1, "out"), (2, "out"), (3, "out")],
        ),
        # two test environments (1 and 3): a leave-one-domain-out pair run
        (
            DOMAINBED_PARTS,
            [0, 2],
            [(0, "out"), (1, "in"), (1, "out"), (2, "out"), (3, "in"), (3, "out")],
        ),
        # the in-domain split: the training environments' 'test' parts are evaluated too
        (
            IN_DOMAIN_PARTS,
            [1, 2, 3],
            [(0, "in"), (0, "out"), (0, "test"), (1, "out"), (1, "test"), (2, "out"),
             (2, "test"), (3, "out"), (3, "test")],
        ),
        (
            IN_DOMAIN_PARTS,
            [0, 2],
            [(0, "out"), (0, "test"), (1, "in"), (1, "out"), (1, "test"), (2, "out"),
             (2, "test"), (3, "in"), (3, "out"), (3, "test")],
        ),
    ],
)
def test_evaluated_parts_is_the_rule_written_out(parts, train_envs, fast):
    splits = [dict(parts) for _ in range(4)]
    assert evaluated_parts(splits, train_envs, "fast") == fast
    assert evaluated_parts(splits, train_envs, "all") == [
        (env, part) for env in range(4) for part in parts
    ]
    test_envs = set(range(4)) - set(train_envs)
    assert set(fast) == fast_keys(splits, test_envs)
    with pytest.raises(ValueError, match="'fast' or 'all'"):
        evaluated_parts(splits, train_envs, "some")


def test_an_empty_split_part_is_refused_when_the_evaluator_is_built():
    config = digits_config(holdout_fraction=0.001)  # int(300 * 0.001) = 0 'out' examples
    dataset = data_lib.from_config(config)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match=r"Empty split parts: env0 \(0\) 'out'"):
        Evaluator(Linear(), dataset, mesh, config, train_envs=[1, 2, 3, 4, 5])


class Featurizer(nn.Module):
    """features = tanh(flatten(x) @ body), logits = features @ classifier (MTL's base)."""

    @nn.compact
    def __call__(self, x, train: bool = False, features: bool = False):
        del train
        h = jnp.tanh(nn.Dense(8, name="body")(x.reshape((x.shape[0], -1))))
        logits = nn.Dense(10, name="classifier")(h)
        return (h, logits) if features else logits


def test_mtl_evaluation_draws_fresh_noise_for_every_batch(monkeypatch):
    """MTL's N(0, 1) embedding at evaluation, as the evaluator draws it over the parts of
    RotatedDigits in batches of 64 (DomainBed's ``MTL.predict`` draws afresh in every
    call): no row of draws repeats across the batches and parts, the draws are N(0, 1)
    (Kolmogorov-Smirnov), and a second evaluation draws exactly the same (deterministic)."""
    from scipy import stats

    from sagm_jax import methods
    from sagm_jax.methods import adaptive, networks

    draws = []
    drawn = adaptive.embedding_noise

    def recorded(key, shape):
        z = drawn(key, shape)
        jax.debug.callback(lambda v: draws.append(np.asarray(v)), z)
        return z

    monkeypatch.setattr(adaptive, "embedding_noise", recorded)
    config = digits_config(objective="mtl")
    dataset = data_lib.from_config(config)
    entry = methods.objective("mtl")
    hp = {"mtl_ema": 0.99, "mtl_embedding": "noise", networks.BATCH_PER_ENV: 8}
    net = Featurizer()
    variables = net.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    own = entry.network.init(jax.random.key(1), networks.Shapes((28, 28, 1), 8, 10, 5), hp)
    variables = networks.with_method_variables(dict(variables), own)
    model = networks.MethodModel(net, entry.network, hp)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    evaluator = Evaluator(model, dataset, mesh, config, train_envs=[1, 2, 3, 4, 5])
    state = types.SimpleNamespace(params=variables["params"], batch_stats={}, step=10)
    evaluator(state)
    first, draws[:] = list(draws), []
    evaluator(state)
    assert len(first) >= 10 and all(np.array_equal(a, b) for a, b in zip(first, draws))
    rows = np.concatenate(first)
    assert len({r.tobytes() for r in rows}) == len(rows), "a row of draws repeats"
    assert stats.kstest(rows.ravel(), "norm").pvalue > 1e-3
