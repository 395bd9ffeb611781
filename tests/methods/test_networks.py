"""A method's own modules and prediction (``sagm_jax.methods.networks``): where their
variables live, how the wrapped network predicts and returns its statistics, and the
network's classifier on other features."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.methods import networks
from sagm_jax.methods.networks import OWN, MethodModel, MethodNetwork


def _cnn_and_variables(channels=1):
    model = models.create("mnist_cnn", 3, input_channels=channels, cnn_widths=(8, 8, 8, 8))
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, channels)), train=False)
    return model, variables


def test_method_variables_sit_beside_the_network_and_come_apart_again():
    _, variables = _cnn_and_variables()
    own = {"params": {"w": jnp.ones(2)}, "batch_stats": {"mean": jnp.zeros(2)}}
    merged = networks.with_method_variables(variables, own)
    assert merged["params"][OWN] is own["params"] and merged["batch_stats"][OWN] is own["batch_stats"]
    network, back = networks.split_variables(merged)
    assert back == own
    assert set(network["params"]) == set(variables["params"])
    assert network["batch_stats"] == {}


def test_the_classifier_on_the_networks_own_features_gives_its_logits():
    model, variables = _cnn_and_variables()
    images = jax.random.normal(jax.random.key(1), (5, 8, 8, 1))
    features, logits = model.apply(variables, images, train=False, features=True)
    # The linear head written out in NumPy float64.
    head = jax.tree.map(lambda x: np.asarray(x, np.float64), variables["params"]["classifier"])
    expected = np.asarray(features, np.float64) @ head["kernel"] + head["bias"]
    np.testing.assert_allclose(networks.classify(variables["params"], features), expected,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def _shifted_prediction(base, own, images, train, hp):
    """A toy method: the network's logits plus its own bias times ``hp['scale']``; in
    training mode its 'count' statistic advances by one."""
    features, logits = base(images)
    stats = {"count": own["batch_stats"]["count"] + 1} if train else None
    return (features, logits + hp["scale"] * own["params"]["bias"]), stats


def test_the_wrapped_network_predicts_the_methods_way_and_returns_its_statistics():
    model, variables = _cnn_and_variables()
    own = {"params": {"bias": jnp.arange(3.0)}, "batch_stats": {"count": jnp.zeros([])}}
    merged = networks.with_method_variables(variables, own)
    wrapped = MethodModel(model, MethodNetwork(predict=_shifted_prediction), {"scale": 2.0})
    images = jax.random.normal(jax.random.key(2), (4, 8, 8, 1))
    plain = model.apply(variables, images, train=False)
    np.testing.assert_allclose(wrapped.apply(merged, images), plain + 2.0 * np.arange(3.0),
                               rtol=1e-6)
    (features, logits), updated = wrapped.apply(
        merged, images, train=True, features=True, mutable=["batch_stats"]
    )
    assert features.shape == (4, 8)
    np.testing.assert_allclose(logits, plain + 2.0 * np.arange(3.0), rtol=1e-6)
    assert float(updated["batch_stats"][OWN]["count"]) == 1.0


def test_a_method_without_its_own_prediction_keeps_the_network():
    model, _ = _cnn_and_variables()
    assert networks.wrap(model, None, {}) is model
    assert networks.wrap(model, MethodNetwork(init=lambda *a: {}), {}) is model
    assert networks.input_shape_for(MethodNetwork(extra_input_channels=1), (8, 8, 3)) == (8, 8, 4)


@pytest.fixture
def registered_own_bias():
    """An objective ``own_bias`` whose module is a class bias, registered for one test."""
    from sagm_jax.methods import registry
    from sagm_jax.methods.objectives import _erm

    def init(key, shapes, hp):
        return {"params": {"bias": jax.random.normal(key, (shapes.num_classes,))},
                "batch_stats": {"count": jnp.zeros([])}}

    entry = registry.Objective(
        registry.Method("own_bias", "OwnBias", (), "a class bias of its own", "test"),
        _erm, network=MethodNetwork(init=init, predict=_shifted_prediction,
                                    extra_input_channels=2),
    )
    registry.register_objective(entry)
    yield entry
    del registry.OBJECTIVES["own_bias"]


def test_the_runs_network_carries_the_methods_modules(registered_own_bias):
    from ml_collections import ConfigDict

    from sagm_jax.config import mnist_config

    config = mnist_config("RotatedDigits")
    config.cnn_widths = (8, 8, 8, 8)
    config = ConfigDict({**config.to_dict(), "objective": "own_bias"})
    key = jax.random.key(3)
    model, variables, _ = networks.from_config(config, 10, (8, 8, 1), 5, key)
    assert isinstance(model, MethodModel)
    # The network takes the method's two extra channels; the bias is drawn from fold_in(key, 1).
    assert variables["params"]["conv1"]["kernel"].shape[2] == 3
    np.testing.assert_array_equal(
        variables["params"][OWN]["bias"], jax.random.normal(jax.random.fold_in(key, 1), (10,))
    )
    assert float(variables["batch_stats"][OWN]["count"]) == 0.0
