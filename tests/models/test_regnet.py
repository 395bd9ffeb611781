"""Our RegNetY against torchvision's own outputs (golden file from experiments/make_regnet_golden.py).

The weights and images are regenerated from sagm_jax.models.synthetic, the same code
the golden script used; the golden outputs come from torchvision's ``regnet_y_16gf``
(and a reduced ``torchvision.models.regnet.RegNet``) in float32. No torch is needed
here. Everything but the one full-size forward runs on the reduced network.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sagm_jax.models import regnet, regnet_weights
from sagm_jax.models.resnet import INTERMEDIATES
from sagm_jax.models.synthetic import (
    REGNET_GOLDEN_BATCH,
    REGNET_GOLDEN_IMAGE_SEED,
    REGNET_GOLDEN_SIZE,
    REGNET_GOLDEN_WEIGHT_SEED,
    REGNET_SMALL_CLASSES,
    REGNET_SMALL_IMAGE_SEED,
    REGNET_SMALL_PARAMS,
    REGNET_SMALL_SIZE,
    REGNET_SMALL_STEM,
    REGNET_SMALL_WEIGHT_SEED,
    draw_images,
    draw_regnet_weights,
    weights_fingerprint,
)
from sagm_jax.models.torchvision_weights import (
    convert_layout,
    torchvision_layout,
    with_pretrained_backbone,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_regnet.npz")
TOLERANCE = 1e-5  # max |ours - torchvision| relative to max |torchvision|
STAGES = ("stem", "block1", "block2", "block3", "block4")
SMALL = regnet.BlockParams(*REGNET_SMALL_PARAMS)


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


def small_model(**kwargs) -> regnet.RegNet:
    return regnet.RegNet(
        num_classes=REGNET_SMALL_CLASSES,
        stem_width=REGNET_SMALL_STEM,
        depths=SMALL.depths,
        widths=SMALL.widths,
        group_widths=SMALL.group_widths,
        bottleneck_multipliers=SMALL.bottleneck_multipliers,
        **kwargs,
    )


def small_variables() -> dict:
    layout = regnet_weights.regnet_layout(REGNET_SMALL_CLASSES, SMALL, stem_width=REGNET_SMALL_STEM)
    weights = draw_regnet_weights(
        REGNET_SMALL_WEIGHT_SEED, REGNET_SMALL_CLASSES, REGNET_SMALL_PARAMS, REGNET_SMALL_STEM
    )
    return convert_layout(weights, layout, "reduced RegNetY")


def small_images(batch: int = 4) -> np.ndarray:
    images = draw_images(REGNET_SMALL_IMAGE_SEED, 4, REGNET_SMALL_SIZE).transpose(0, 2, 3, 1)
    return images[:batch]


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as archive:
        return {key: archive[key] for key in archive.files}


@pytest.fixture(scope="module")
def full_weights():
    return draw_regnet_weights(REGNET_GOLDEN_WEIGHT_SEED)


def test_block_params_match_torchvision(golden):
    names = [str(name) for name in golden["params_names"]]
    assert "regnet_y_16gf" in names and len(names) >= 10
    for name in names:
        depth, w_0, w_a, w_m, group_width, multiplier = golden[f"params_{name}_settings"]
        ours = regnet.regnet_block_params(
            int(depth), int(w_0), w_a, w_m, int(group_width), multiplier
        )
        assert list(ours.depths) == golden[f"params_{name}_depths"].tolist(), name
        assert list(ours.widths) == golden[f"params_{name}_widths"].tolist(), name
        assert list(ours.group_widths) == golden[f"params_{name}_group_widths"].tolist(), name
        assert list(ours.bottleneck_multipliers) == golden[f"params_{name}_multipliers"].tolist(), (
            name
        )
    assert regnet.REGNET_Y_16GF.widths == (224, 448, 1232, 3024)
    assert regnet.REGNET_Y_16GF.depths == (2, 4, 11, 1)
    assert regnet.FEATURE_DIM == regnet.REGNET_Y_16GF.widths[-1]


def test_fingerprints(golden, full_weights):
    message = (
        "the drawn weights differ from the golden file's; rerun experiments/make_regnet_golden.py"
    )
    assert weights_fingerprint(full_weights) == str(golden["fingerprint"]), message
    small = draw_regnet_weights(
        REGNET_SMALL_WEIGHT_SEED, REGNET_SMALL_CLASSES, REGNET_SMALL_PARAMS, REGNET_SMALL_STEM
    )
    assert weights_fingerprint(small) == str(golden["small_fingerprint"]), message


def test_regnet_y_16gf_matches_torchvision(golden, full_weights):
    """One forward of the full network at 224x224: logits, feature, MIRO's features."""
    variables = regnet_weights.convert_regnet(full_weights)
    model = regnet.build(1000)
    forward = jax.jit(
        lambda v, x: model.apply(v, x, train=False, features=True, mutable=[INTERMEDIATES])
    )
    images = draw_images(REGNET_GOLDEN_IMAGE_SEED, REGNET_GOLDEN_BATCH, REGNET_GOLDEN_SIZE)
    with jax.default_matmul_precision("float32"):
        (feature, logits), state = forward(variables, images.transpose(0, 2, 3, 1))
    errors = {
        "logits": relative_error(logits, golden["logits"]),
        "feature": relative_error(feature, golden["feature"]),
    }
    assert feature.shape == (REGNET_GOLDEN_BATCH, regnet.FEATURE_DIM)
    sown = state[INTERMEDIATES]
    for name in STAGES:
        (value,) = sown[name]
        assert value.shape == tuple(golden[f"{name}_shape"]), name
        errors[f"{name} means"] = relative_error(value.mean(axis=(1, 2)), golden[f"{name}_mean"])
        errors[f"{name} corner"] = relative_error(value[:, :3, :3, :8], golden[f"{name}_corner"])
    print("max relative errors: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert all(error < TOLERANCE for error in errors.values()), errors


def test_converted_variables_fit_the_network(full_weights):
    """Every converted entry has the path and shape the network's init gives it."""
    variables = regnet_weights.convert_regnet(full_weights)
    shapes = jax.eval_shape(
        lambda: regnet.build(1000).init(
            jax.random.PRNGKey(0), jnp.zeros((1, 64, 64, 3)), train=False
        )
    )
    expected = {path: tuple(s.shape) for path, s in flatten_dict(shapes).items()}
    assert {path: np.shape(v) for path, v in flatten_dict(variables).items()} == expected


def test_small_eval_and_train_modes_match_torchvision(golden):
    """Reduced network at 36x36: eval, train with batch statistics and the running
    updates (torch's unbiased variance vs Flax's biased one: factor N / (N - 1))."""
    variables = small_variables()
    images = small_images()

    @jax.jit
    def forward(variables, images):
        eval_logits = small_model().apply(variables, images, train=False)
        frozen = small_model().apply(variables, images, train=True)
        trainable = small_model(freeze_batchnorm=False)
        return (
            eval_logits,
            frozen,
            trainable.apply(variables, images, train=True, mutable=["batch_stats"]),
        )

    eval_logits, frozen, (logits, updated) = forward(variables, images)
    assert relative_error(eval_logits, golden["small_eval_logits"]) < TOLERANCE
    # frozen BatchNorm: training uses the running statistics, as evaluation does
    np.testing.assert_allclose(frozen, eval_logits, rtol=0, atol=1e-6)
    assert relative_error(logits, golden["small_train_logits"]) < TOLERANCE
    paths = {"stem.1": ("bn1",), "trunk_output.block4.block4-0.f.c.1": ("block4_0", "c_bn")}
    for torch_name, path in paths.items():
        old, new = variables["batch_stats"], updated["batch_stats"]
        for key in path:
            old, new = old[key], new[key]
        torch_mean = golden[f"small_{torch_name}.running_mean"]
        np.testing.assert_allclose(new["mean"], torch_mean, rtol=1e-5, atol=1e-6)
        count = images.shape[0] * (REGNET_SMALL_SIZE // 2 if path == ("bn1",) else 2) ** 2
        batch_var = (np.asarray(new["var"]) - 0.9 * old["var"]) / 0.1 * count / (count - 1)
        torch_var = 0.9 * old["var"] + 0.1 * batch_var
        np.testing.assert_allclose(torch_var, golden[f"small_{torch_name}.running_var"], rtol=1e-4)


def test_sown_intermediates_names_and_shapes():
    variables = small_variables()
    images = small_images(2)

    @jax.jit
    def forward(variables, images):
        plain = small_model().apply(variables, images, train=False)
        return plain, small_model().apply(variables, images, train=False, mutable=[INTERMEDIATES])

    plain, (logits, state) = forward(variables, images)
    shapes = {name: value[0].shape for name, value in state[INTERMEDIATES].items()}
    assert shapes == {
        "stem": (2, 18, 18, 8),
        "block1": (2, 9, 9, 16),
        "block2": (2, 5, 5, 24),
        "block3": (2, 3, 3, 48),
        "block4": (2, 2, 2, 64),
    }
    np.testing.assert_allclose(logits, plain, rtol=0, atol=1e-6)  # sowing changes nothing


def test_gradient_flows_to_every_parameter():
    variables = small_variables()
    model = small_model(dropout_rate=0.1)
    images, labels = small_images(2), jnp.array([1, 3])

    def loss(params):
        logits = model.apply(
            {**variables, "params": params},
            images,
            train=True,
            mixstyle=True,
            rngs={"dropout": jax.random.PRNGKey(1)},
        )
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(2), labels])

    grads = jax.jit(jax.grad(loss))(variables["params"])
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for _, g in leaves)
    dead = [jax.tree_util.keystr(p) for p, g in leaves if not bool(jnp.any(g != 0))]
    assert not dead, f"no gradient reaches {dead}"


def test_bfloat16_forward():
    """The train step's bfloat16 mode casts parameters and images: the network follows."""
    variables = small_variables()
    images = small_images(2)
    to_bf16 = lambda tree: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), tree)

    @jax.jit
    def forward(variables, images):
        full = small_model().apply(variables, images, train=False)
        return full, small_model().apply(to_bf16(variables), to_bf16(images), train=False)

    full, half = forward(variables, images)
    assert half.dtype == jnp.bfloat16
    assert relative_error(np.asarray(half, np.float32), np.asarray(full)) < 0.05


def test_build_interface_and_feature_width():
    model = regnet.build(
        7, dropout_rate=0.2, freeze_batchnorm=False, input_channels=4, image_size=384
    )
    assert (
        model.num_classes,
        model.dropout_rate,
        model.freeze_batchnorm,
        model.input_channels,
    ) == (7, 0.2, False, 4)
    assert regnet.MEAN == (0.485, 0.456, 0.406) and regnet.STD == (0.229, 0.224, 0.225)
    assert regnet.FEATURE_MAPS is True
    x = jnp.zeros((2, 64, 64, 4))
    shapes = jax.eval_shape(
        lambda: model.init_with_output(jax.random.PRNGKey(0), x, train=False, features=True)[0]
    )
    assert (shapes[0].shape, shapes[1].shape) == ((2, 3024), (2, 7))
    with pytest.raises(ValueError, match="4 input channels"):
        jax.eval_shape(
            lambda: small_model(input_channels=4).init(
                jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False
            )
        )


def test_traced_dropout_rate():
    """A pack's runs pass the dropout rate traced: rate 0 is the identity."""
    variables = small_variables()
    images = small_images(2)

    @jax.jit
    def forward(rate):
        dropped = small_model(dropout_rate=rate).apply(
            variables, images, train=True, rngs={"dropout": jax.random.PRNGKey(0)}
        )
        return dropped, small_model().apply(variables, images, train=True)

    kept, reference = forward(jnp.float32(0.0))
    np.testing.assert_allclose(kept, reference, rtol=1e-6, atol=1e-6)
    dropped, _ = forward(jnp.float32(0.5))
    assert not np.allclose(dropped, reference)


def test_pretrained_backbone_keeps_the_fresh_head():
    converted = small_variables()
    model = small_model(input_channels=4)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 4)), train=False)
    )
    # with_pretrained_backbone reads the fresh entries' shapes and dtypes, and keeps the head.
    fresh = jax.tree_util.tree_map(lambda s: np.full(s.shape, 0.5, s.dtype), shapes)
    merged = with_pretrained_backbone(fresh, converted)
    np.testing.assert_array_equal(
        merged["params"]["classifier"]["kernel"], fresh["params"]["classifier"]["kernel"]
    )
    stem = converted["params"]["conv1"]["kernel"]
    np.testing.assert_array_equal(merged["params"]["conv1"]["kernel"], stem[:, :, [0, 1, 2, 0], :])
    np.testing.assert_array_equal(
        merged["params"]["block2_0"]["se"]["fc1"]["bias"],
        converted["params"]["block2_0"]["se"]["fc1"]["bias"],
    )


def test_swag_layout_converts_to_the_same_variables(full_weights):
    torchvision = regnet_weights.convert_regnet(full_weights)
    swag = {regnet_weights.swag_key(key): value for key, value in full_weights.items()}
    # The names SWAG's models/regnet.py (ClassyVision's RegNet) gives these modules.
    block = "trunk_output.block2.block2-0."
    for name in (
        "stem.stem.0.weight",
        "stem.stem.1.running_var",
        "head.fc.weight",
        block + "proj.weight",
        block + "bn.bias",
        block + "f.a.0.weight",
        block + "f.b.1.running_mean",
        block + "f.se.excitation.0.weight",
        block + "f.se.excitation.2.bias",
        block + "f.c.weight",
        block + "f.final_bn.weight",
    ):
        assert name in swag, name
    converted = regnet_weights.convert_regnet(swag)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, converted, torchvision))
    trunk = {k: v.astype(np.float16) for k, v in swag.items() if not k.startswith("head.")}
    without_head = regnet_weights.convert_regnet({"module." + k: v for k, v in trunk.items()})
    assert "classifier" not in without_head["params"]
    kernel = without_head["params"]["block3_1"]["b_conv"]["kernel"]
    assert kernel.dtype == np.float32
    np.testing.assert_array_equal(
        kernel, torchvision["params"]["block3_1"]["b_conv"]["kernel"].astype(np.float16)
    )


def test_conversion_errors_name_the_keys(full_weights):
    key = "trunk_output.block3.block3-4.f.se.fc2.weight"
    missing = {k: v for k, v in full_weights.items() if k != key}
    with pytest.raises(ValueError, match=f"missing keys \\(1\\): {key}"):
        regnet_weights.convert_regnet(missing)
    with pytest.raises(ValueError, match="unexpected keys \\(1\\): trunk_output.block5.extra"):
        regnet_weights.convert_regnet({**full_weights, "trunk_output.block5.extra": np.zeros(3)})
    misshaped = {**full_weights, key: np.zeros((1232, 300, 1, 1), np.float32)}
    with pytest.raises(
        ValueError, match=f"{key} has shape \\(1232, 300, 1, 1\\), expected \\(1232, 308, 1, 1\\)"
    ):
        regnet_weights.convert_regnet(misshaped)
    swag = {regnet_weights.swag_key(k): v for k, v in full_weights.items()}
    del swag["trunk_output.block1.block1-0.f.final_bn.weight"]
    with pytest.raises(ValueError, match="SWAG regnety_16gf.*block1-0.f.final_bn.weight"):
        regnet_weights.convert_regnet(swag)


def test_detect_regnet(full_weights):
    keys = dict.fromkeys(full_weights, 0)
    assert regnet_weights.detect_regnet(keys)
    assert regnet_weights.detect_regnet({"module." + k: v for k, v in keys.items()})
    assert regnet_weights.detect_regnet({regnet_weights.swag_key(k): v for k, v in keys.items()})
    assert not regnet_weights.detect_regnet(
        {e.torch_key: 0 for e in torchvision_layout("resnet50")}
    )
    assert not regnet_weights.detect_regnet({})
