"""DomainBed's MNIST CNN against an independent NumPy forward pass with torch's conventions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import models


def numpy_conv(x, kernel, bias, stride):
    """NHWC convolution with zero padding 1 on each side (torch's padding=1), in float64."""
    x = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    batch, height, width, _ = x.shape
    out_h, out_w = (height - 3) // stride + 1, (width - 3) // stride + 1
    out = np.zeros((batch, out_h, out_w, kernel.shape[-1]))
    for i in range(3):
        for j in range(3):
            patch = x[:, i : i + stride * out_h : stride, j : j + stride * out_w : stride, :]
            out += patch @ kernel[i, j]
    return out + bias


def numpy_groupnorm(x, groups, scale, bias, eps=1e-5):
    batch, height, width, channels = x.shape
    grouped = x.reshape(batch, height, width, groups, channels // groups)
    mean = grouped.mean(axis=(1, 2, 4), keepdims=True)
    var = grouped.var(axis=(1, 2, 4), keepdims=True)
    normed = ((grouped - mean) / np.sqrt(var + eps)).reshape(x.shape)
    return normed * scale + bias


def numpy_mnist_cnn(params, x):
    x = np.asarray(x, np.float64)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    for index, stride in zip(range(1, 5), (1, 2, 1, 1)):
        x = numpy_conv(x, p[f"conv{index}"]["kernel"], p[f"conv{index}"]["bias"], stride)
        x = np.maximum(x, 0.0)  # DomainBed's order: conv -> relu -> groupnorm
        x = numpy_groupnorm(x, 8, p[f"groupnorm{index}"]["scale"], p[f"groupnorm{index}"]["bias"])
    return x.mean(axis=(1, 2)) @ p["classifier"]["kernel"] + p["classifier"]["bias"]


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_forward_matches_numpy(channels):
    model = models.create("mnist_cnn", 10, input_channels=channels)
    x = jax.random.normal(jax.random.PRNGKey(channels), (3, 28, 28, channels))
    variables = model.init(jax.random.PRNGKey(0), x, train=False)
    assert set(variables) == {"params"}  # GroupNorm only: no batch_stats
    params = variables["params"]
    assert params["conv1"]["kernel"].shape == (3, 3, channels, 64)
    assert [params[f"conv{i}"]["kernel"].shape[-1] for i in range(1, 5)] == [64, 128, 128, 128]
    assert params["classifier"]["kernel"].shape == (128, 10)
    # Non-trivial GroupNorm affine parameters, so scale and bias are checked too.
    rng = np.random.default_rng(channels)
    for i in range(1, 5):
        params[f"groupnorm{i}"] = {
            "scale": rng.uniform(0.5, 1.5, 128 if i > 1 else 64).astype(np.float32),
            "bias": rng.normal(0, 0.1, 128 if i > 1 else 64).astype(np.float32),
        }
    with jax.default_matmul_precision("float32"):
        logits = model.apply({"params": params}, x, train=False)
    assert logits.shape == (3, 10)
    np.testing.assert_allclose(logits, numpy_mnist_cnn(params, x), rtol=1e-4, atol=1e-4)


def test_second_conv_halves_the_resolution():
    model = models.create("mnist_cnn", 2, input_channels=2)
    x = jnp.zeros((1, 28, 28, 2))
    variables = model.init(jax.random.PRNGKey(0), x, train=False)
    _, state = model.apply(
        variables, x, train=False, capture_intermediates=True, mutable=["intermediates"]
    )
    shapes = [state["intermediates"][f"conv{i}"]["__call__"][0].shape for i in range(1, 5)]
    assert shapes == [(1, 28, 28, 64), (1, 14, 14, 128), (1, 14, 14, 128), (1, 14, 14, 128)]


def test_dropout_option_and_errors():
    model = models.create("mnist_cnn", 10, dropout_rate=0.5, input_channels=1)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 28, 28, 1))
    variables = model.init(jax.random.PRNGKey(0), x, train=False)
    train = model.apply(variables, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)})
    assert not np.allclose(train, model.apply(variables, x, train=False))
    with pytest.raises(ValueError, match="1 input channels"):
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)), train=False)
    with pytest.raises(ValueError, match="no MixStyle"):
        models.create("mnist_cnn", 10, mixstyle_after=(1,))
