"""The ResNet module: create(), BatchNorm frozen and trainable, dropout, gradients.

Compiling a ResNet dominates the time of these tests, so the jitted functions and
initialised variables are shared through module-scoped fixtures, and pure shape
checks use ``jax.eval_shape`` (tracing only).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.models.synthetic import draw_torchvision_weights

SIZE = 32  # small images keep these tests fast; parity at other sizes is in test_resnet_parity
NUM_CLASSES = 5


@functools.lru_cache(maxsize=None)
def fresh_variables(arch):
    """Drawn with the "rbg" generator: the init compiled with threefry's draws took 6 s."""
    model = models.create(arch, NUM_CLASSES)
    return jax.jit(lambda key, x: model.init(key, x, train=False))(
        jax.random.key(0, impl="rbg"), jnp.zeros((1, SIZE, SIZE, 3))
    )


def pretrained(arch="resnet18", **kwargs):
    """A DomainBed model whose backbone carries random non-trivial running statistics."""
    model = models.create(arch, NUM_CLASSES, **kwargs)
    converted = models.convert_torchvision(draw_torchvision_weights(arch, seed=1))
    return model, models.with_pretrained_backbone(fresh_variables(arch), converted)


def images(batch=4, size=SIZE, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, size, size, 3))


def test_create_rejects_unknown_arch_listing_valid_ones():
    with pytest.raises(ValueError, match="resnet18.*resnet50.*mnist_cnn"):
        models.create("resnet34", 10)


def test_create_rejects_bad_mixstyle_stage():
    with pytest.raises(ValueError, match=r"\[4\]"):
        models.create("resnet18", 10, mixstyle_after=(1, 4))


@pytest.mark.parametrize("arch, feature_size", [("resnet18", 512), ("resnet50", 2048)])
def test_variables_and_logits_shape(arch, feature_size):
    model = models.create(arch, 7)
    variables = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 3)), train=False)
    )
    assert set(variables) == {"params", "batch_stats"}
    assert variables["params"]["classifier"]["kernel"].shape == (feature_size, 7)
    assert variables["params"]["conv1"]["kernel"].shape == (7, 7, 3, 64)
    logits = jax.eval_shape(lambda v, x: model.apply(v, x, train=False), variables, images(batch=3))
    assert logits.shape == (3, 7)


def test_wrong_channel_count_is_a_clear_error():
    model = models.create("resnet18", 7)
    with pytest.raises(ValueError, match="3 input channels"):
        jax.eval_shape(
            lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 1)), train=False)
        )


def test_frozen_batchnorm_uses_running_stats_in_training_and_keeps_them():
    model, variables = pretrained()
    x = images()

    @jax.jit
    def train_and_eval(v, x):
        train_logits, updates = model.apply(v, x, train=True, mutable=["batch_stats"])
        return train_logits, updates, model.apply(v, x, train=False)

    train_logits, updates, eval_logits = train_and_eval(variables, x)
    # With dropout off, training mode computes exactly what eval mode computes.
    np.testing.assert_allclose(train_logits, eval_logits, rtol=1e-6, atol=1e-6)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, updates["batch_stats"], variables["batch_stats"]
    )


def test_frozen_batchnorm_scale_and_bias_are_trained():
    model, variables = pretrained()
    x = images(batch=2)

    def loss(params):
        logits = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]}, x, train=True
        )
        return jnp.sum(logits**2)

    grads = jax.jit(jax.grad(loss))(variables["params"])
    assert np.abs(grads["bn1"]["scale"]).sum() > 0
    assert np.abs(grads["layer4_1"]["bn2"]["bias"]).sum() > 0


def test_trainable_batchnorm_uses_batch_stats_and_updates_running_stats():
    model, variables = pretrained(freeze_batchnorm=False)
    x = images()

    @jax.jit
    def train_and_eval(v, x):
        _, state = model.apply(
            v, x, train=True, mutable=["batch_stats", "intermediates"], capture_intermediates=True
        )
        _, eval_state = model.apply(v, x, train=False, mutable=["batch_stats"])
        return state, eval_state

    state, eval_state = train_and_eval(variables, x)
    stem = np.asarray(state["intermediates"]["conv1"]["__call__"][0], dtype=np.float64)
    old = variables["batch_stats"]["bn1"]
    new = state["batch_stats"]["bn1"]
    # torch momentum 0.1: running = 0.9 * running + 0.1 * batch statistic
    np.testing.assert_allclose(
        new["mean"], 0.9 * old["mean"] + 0.1 * stem.mean(axis=(0, 1, 2)), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        new["var"], 0.9 * old["var"] + 0.1 * stem.var(axis=(0, 1, 2)), rtol=1e-4, atol=1e-5
    )
    # In training the stem BN normalises with the batch statistics.
    bn_out = np.asarray(state["intermediates"]["bn1"]["__call__"][0])
    scale, bias = variables["params"]["bn1"]["scale"], variables["params"]["bn1"]["bias"]
    expected = (stem - stem.mean(axis=(0, 1, 2))) / np.sqrt(
        stem.var(axis=(0, 1, 2)) + 1e-5
    ) * scale + bias
    np.testing.assert_allclose(bn_out, expected, rtol=1e-4, atol=1e-4)
    # In evaluation the running statistics are used and nothing changes.
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, eval_state["batch_stats"], variables["batch_stats"]
    )


def test_dropout_acts_only_in_training_and_follows_its_key():
    model, variables = pretrained(dropout_rate=0.5)
    x = images()

    @jax.jit
    def run(key):
        return model.apply(variables, x, train=True, rngs={"dropout": key}), model.apply(
            variables, x, train=False
        )

    train_0, eval_logits = run(jax.random.PRNGKey(0))
    again_0, eval_again = run(jax.random.PRNGKey(0))
    train_1, _ = run(jax.random.PRNGKey(1))
    assert not np.allclose(train_0, eval_logits)
    np.testing.assert_array_equal(train_0, again_0)
    np.testing.assert_array_equal(eval_logits, eval_again)
    assert not np.allclose(train_0, train_1)


def test_with_pretrained_backbone_keeps_fresh_head_and_replaces_backbone():
    fresh = fresh_variables("resnet18")
    converted = models.convert_torchvision(draw_torchvision_weights("resnet18", seed=3))
    merged = models.with_pretrained_backbone(fresh, converted)
    np.testing.assert_array_equal(
        merged["params"]["classifier"]["kernel"], fresh["params"]["classifier"]["kernel"]
    )
    np.testing.assert_array_equal(
        merged["params"]["layer2_0"]["downsample_conv"]["kernel"],
        converted["params"]["layer2_0"]["downsample_conv"]["kernel"],
    )
    np.testing.assert_array_equal(
        merged["batch_stats"]["layer3_1"]["bn2"]["var"],
        converted["batch_stats"]["layer3_1"]["bn2"]["var"],
    )


def test_with_pretrained_backbone_rejects_the_wrong_architecture_naming_entries():
    model = models.create("resnet50", NUM_CLASSES)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 3)), train=False)
    )
    fresh = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    converted = models.convert_torchvision(draw_torchvision_weights("resnet18", seed=3))
    with pytest.raises(
        ValueError,
        match=r"missing from the converted weights: .*layer1_0/bn3/mean.*"
        r"mis-shaped: .*params/layer1_0/conv1/kernel: converted \(3, 3, 64, 64\)",
    ):
        models.with_pretrained_backbone(fresh, converted)


def _numpy_convolution(x, w, stride, pad):
    """Float64 convolution by its definition: torchvision's padding, NHWC x HWIO."""
    k = w.shape[0]
    x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    out_h = (x.shape[1] - k) // stride + 1
    out_w = (x.shape[2] - k) // stride + 1
    out = np.zeros((x.shape[0], out_h, out_w, w.shape[-1]))
    for i in range(out_h):
        for j in range(out_w):
            window = x[:, i * stride : i * stride + k, j * stride : j * stride + k, :]
            out[:, i, j] = np.einsum("bhwc,hwco->bo", window, w)
    return out


@pytest.mark.parametrize("kernel,stride", [(1, 1), (1, 2), (3, 1), (3, 2), (7, 2)])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_conv_as_patches_equals_the_convolution(kernel, stride, size):
    """The CPU's dot-of-windows form of a convolution (used where XLA's CPU convolution
    is slow: kernels larger than the map, 1x1): values against a float64 convolution by
    its definition, gradients against XLA's convolution."""
    from sagm_jax.models.cpu_ops import conv_as_patches

    rng = np.random.default_rng(kernel * 100 + stride * 10 + size)
    x = rng.normal(size=(2, size, size, 5))
    w = rng.normal(size=(kernel, kernel, 5, 4))
    pad = kernel // 2
    x32, w32 = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)

    def xla(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (stride, stride), ((pad, pad), (pad, pad)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=jax.lax.Precision.HIGHEST,
        )

    patches = lambda x, w: conv_as_patches(x, w, stride, pad)  # noqa: E731
    got = jax.jit(patches)(x32, w32)  # compiled: eagerly, each of the k*k slices compiles
    np.testing.assert_allclose(got, _numpy_convolution(x, w, stride, pad), rtol=1e-5, atol=1e-5)
    squared = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)  # noqa: E731
    got_grads = jax.jit(jax.grad(squared(patches), (0, 1)))(x32, w32)
    for g, e in zip(got_grads, jax.jit(jax.grad(squared(xla), (0, 1)))(x32, w32)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def _numpy_max_pool(x, window, stride, pad, dy):
    """Max-pooling by its definition, in float64, and torch's gradient rule: each output's
    gradient goes to the first maximal position of its window (row-major)."""
    batch, height, width, channels = x.shape
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=-np.inf)
    out_h, out_w = dy.shape[1:3]
    y = np.empty(dy.shape)
    dx = np.zeros(padded.shape)
    for b in range(batch):
        for c in range(channels):
            for i in range(out_h):
                for j in range(out_w):
                    win = padded[b, i * stride : i * stride + window, j * stride : j * stride + window, c]
                    r, s = np.unravel_index(np.argmax(win), win.shape)  # argmax: the first maximum
                    y[b, i, j, c] = win[r, s]
                    dx[b, i * stride + r, j * stride + s, c] += dy[b, i, j, c]
    return y, dx[:, pad : pad + height, pad : pad + width]


@pytest.mark.parametrize("size", [1, 2, 5, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_cpu_max_pool_equals_max_pooling_and_torchs_gradient(size, ties):
    """The CPU's max-pool (ResNet's 3x3, stride 2, pad 1): values exactly, and the
    gradient of the first maximum of each window, against a float64 loop; with many
    ties (small integers) too. XLA's own max-pool gradient agrees."""
    import flax.linen as nn

    from sagm_jax.models.cpu_ops import max_pool

    rng = np.random.default_rng(size + 10 * ties)
    x = rng.integers(0, 3, (2, size, size, 3)) if ties else rng.normal(size=(2, size, size, 3))
    x = x.astype(np.float32)
    out = (size + 2 - 3) // 2 + 1
    dy = rng.normal(size=(2, out, out, 3)).astype(np.float32)
    expected_y, expected_dx = _numpy_max_pool(x.astype(np.float64), 3, 2, 1, dy)
    y, vjp = jax.vjp(lambda x: max_pool(x, 3, 2, 1), jnp.asarray(x))
    np.testing.assert_array_equal(y, expected_y)
    np.testing.assert_allclose(vjp(jnp.asarray(dy))[0], expected_dx, rtol=1e-6, atol=1e-6)
    xla = lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))  # noqa: E731
    np.testing.assert_allclose(
        jax.vjp(xla, jnp.asarray(x))[1](jnp.asarray(dy))[0], expected_dx, rtol=1e-6, atol=1e-6
    )
