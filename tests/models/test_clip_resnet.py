"""CLIP's ResNet-50 image tower against open_clip's own outputs, and its weights' handling.

The golden file comes from experiments/make_clip_resnet_golden.py: open_clip's
``ModifiedResNet`` (``open_clip.create_model('RN50').visual``, and a reduced variant) on
the seeded weights and images of sagm_jax.models.synthetic, which this test regenerates.
No torch is needed here. Everything but the one RN50 forward at 224x224 runs on the
reduced variant (one block per stage, width 8) at 64x64.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax.models import clip_resnet
from sagm_jax.models.clip_resnet import CLIPResNet, build
from sagm_jax.models.clip_resnet_weights import (
    clip_resnet_layout,
    convert_clip_resnet,
    detect_clip_resnet,
)
from sagm_jax.models.resnet import INTERMEDIATES
from sagm_jax.models.synthetic import (
    CLIP_RESNET_IMAGE_SEED as IMAGE_SEED,
)
from sagm_jax.models.synthetic import (
    CLIP_RESNET_ODD_SIZE as ODD_SIZE,
)
from sagm_jax.models.synthetic import (
    CLIP_RESNET_SIZE as SIZE,
)
from sagm_jax.models.synthetic import (
    CLIP_RESNET_SMALL as SMALL,
)
from sagm_jax.models.synthetic import (
    CLIP_RESNET_SMALL_SEED as SMALL_SEED,
)
from sagm_jax.models.synthetic import (
    CLIP_RESNET_SMALL_SIZE as SMALL_SIZE,
)
from sagm_jax.models.synthetic import (
    CLIP_RESNET_WEIGHT_SEED as WEIGHT_SEED,
)
from sagm_jax.models.synthetic import (
    GOLDEN_BATCH as BATCH,
)
from sagm_jax.models.synthetic import (
    draw_clip_resnet_weights,
    draw_images,
    draw_torchvision_weights,
    weights_fingerprint,
)
from sagm_jax.models.torchvision_weights import with_pretrained_backbone

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_clip_resnet.npz")
TOLERANCE = 1e-5  # max |ours - open_clip| relative to max |open_clip|
SMALL_ARCH = {k: v for k, v in SMALL.items() if k != "heads"}  # what the layout depends on
BLOCKS = ("stem", "block1", "block2", "block3", "block4")


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as archive:
        return {key: archive[key] for key in archive.files}


@pytest.fixture(scope="module")
def small_weights():
    return draw_clip_resnet_weights(SMALL_SEED, SMALL_SIZE, **SMALL_ARCH)


def relative_error(ours, reference) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def fresh_variables(model, size, channels=3):
    """Zero variables of the model's structure (shapes only: no forward is run)."""
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, channels)), train=False)
    )
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)


@functools.partial(jax.jit, static_argnames=("model", "train", "features", "mutable"))
def run(model, variables, images, train, features=False, mutable=False, rngs=None):
    """``model.apply``, compiled once per model and mode (tests share the compilations)."""
    return model.apply(
        variables, images, train=train, features=features, mutable=mutable, rngs=rngs
    )


def small_model(**kwargs):
    return CLIPResNet(num_classes=5, image_size=SMALL_SIZE, **SMALL, **kwargs)


def small_variables(weights, model=None, channels=3):
    model = model or small_model()
    converted = convert_clip_resnet(weights, SMALL_SIZE, **SMALL_ARCH)
    variables = with_pretrained_backbone(fresh_variables(model, SMALL_SIZE, channels), converted)
    key = jax.random.key(1)
    variables["params"]["classifier"]["kernel"] = jax.random.normal(key, (SMALL["output_dim"], 5))
    return variables


def small_images(channels=3):
    images = draw_images(IMAGE_SEED + SMALL_SIZE, BATCH, SMALL_SIZE).transpose(0, 2, 3, 1)
    return images if channels == 3 else np.concatenate([images, images[..., :1]], axis=-1)


def test_rn50_feature_and_intermediates_match_open_clip(golden):
    weights = draw_clip_resnet_weights(WEIGHT_SEED, SIZE)
    assert weights_fingerprint(weights) == str(golden["rn50_fingerprint"]), (
        "the drawn weights differ from those the golden file was made with "
        "(NumPy's generator changed?); rerun experiments/make_clip_resnet_golden.py"
    )
    model = build(7, image_size=SIZE)
    variables = with_pretrained_backbone(fresh_variables(model, SIZE), convert_clip_resnet(weights))
    images = draw_images(IMAGE_SEED, BATCH, SIZE).transpose(0, 2, 3, 1)
    forward = jax.jit(
        lambda v, x: model.apply(v, x, train=False, features=True, mutable=[INTERMEDIATES])
    )
    with jax.default_matmul_precision("float32"):
        (feature, logits), state = forward(variables, images)
    assert logits.shape == (BATCH, 7)
    errors = {"feature": relative_error(feature, golden["rn50_feature"])}
    for name in BLOCKS:
        (array,) = state[INTERMEDIATES][name]
        array = np.asarray(array, np.float64)
        errors[f"{name} mean"] = relative_error(
            array.mean(axis=(1, 2)), golden[f"rn50_{name}_mean"]
        )
        norm = np.sqrt((array**2).sum(axis=(1, 2, 3)))
        errors[f"{name} norm"] = relative_error(norm, golden[f"rn50_{name}_norm"])
        errors[f"{name} slice"] = relative_error(
            array[:, :4, :4, :16], golden[f"rn50_{name}_slice"]
        )
    print("RN50 224x224, max relative error:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < TOLERANCE, errors


def test_reduced_variant_eval_and_trainable_batchnorm_match_open_clip(golden, small_weights):
    assert weights_fingerprint(small_weights) == str(golden["small_fingerprint"])
    model = small_model(freeze_batchnorm=False)
    variables = small_variables(small_weights, model)
    images = small_images()
    with jax.default_matmul_precision("float32"):
        evaluated = run(model, variables, images, train=False, features=True)[0]
        (trained, _), state = run(
            model, variables, images, train=True, features=True, mutable=("batch_stats",)
        )
    errors = {
        "eval feature": relative_error(evaluated, golden["small_eval_feature"]),
        "train feature": relative_error(trained, golden["small_train_feature"]),
    }
    print("reduced variant 64x64, max relative error:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < TOLERANCE, errors
    count = {"bn1": BATCH * (SMALL_SIZE // 2) ** 2, "layer4.0.bn3": BATCH * 2 * 2}
    for bn, path in (("bn1", ("bn1",)), ("layer4.0.bn3", ("layer4_0", "bn3"))):
        old = variables["batch_stats"]
        new = state["batch_stats"]
        for name in path:
            old, new = old[name], new[name]
        mean = golden[f"small_{bn}_running_mean"]
        assert relative_error(new["mean"], mean) < TOLERANCE
        # Flax updates the running variance with the biased batch variance, torch with the
        # unbiased one: the batch terms differ by N / (N - 1) exactly.
        n = count[bn]
        ours_batch = (np.asarray(new["var"]) - 0.9 * np.asarray(old["var"])) / 0.1
        torch_batch = (golden[f"small_{bn}_running_var"] - 0.9 * np.asarray(old["var"])) / 0.1
        assert relative_error(ours_batch * n / (n - 1), torch_batch) < 1e-4


def test_reduced_variant_at_an_odd_size_matches_open_clip(golden):
    weights = draw_clip_resnet_weights(SMALL_SEED, ODD_SIZE, **SMALL_ARCH)
    assert weights_fingerprint(weights) == str(golden["odd_fingerprint"])
    model = CLIPResNet(num_classes=5, image_size=ODD_SIZE, **SMALL)
    converted = convert_clip_resnet(weights, ODD_SIZE, **SMALL_ARCH)
    variables = with_pretrained_backbone(fresh_variables(model, ODD_SIZE), converted)
    images = draw_images(IMAGE_SEED + ODD_SIZE, BATCH, ODD_SIZE).transpose(0, 2, 3, 1)
    with jax.default_matmul_precision("float32"):
        feature, _ = run(model, variables, images, train=False, features=True)
    error = relative_error(feature, golden["odd_feature"])
    print(f"reduced variant {ODD_SIZE}x{ODD_SIZE}: max relative error {error:.1e}")
    assert error < TOLERANCE


def test_frozen_batchnorm_uses_and_keeps_running_statistics(small_weights):
    model = small_model()  # freeze_batchnorm=True
    variables = small_variables(small_weights, model)
    images = small_images()
    evaluated = run(model, variables, images, train=False)
    trained, state = run(model, variables, images, train=True, mutable=("batch_stats",))
    np.testing.assert_allclose(trained, evaluated, rtol=1e-6, atol=1e-6)
    same = jax.tree_util.tree_map(np.array_equal, state["batch_stats"], variables["batch_stats"])
    assert all(jax.tree_util.tree_leaves(same))
    trainable = small_model(freeze_batchnorm=False)
    batch_stat_logits, _ = run(trainable, variables, images, train=True, mutable=("batch_stats",))
    assert np.abs(np.asarray(batch_stat_logits) - np.asarray(evaluated)).max() > 1e-3


def test_gradient_flows_to_every_part(small_weights):
    model = small_model(dropout_rate=0.1)
    variables = small_variables(small_weights, model)
    images, labels = small_images(), jnp.array([0, 3])

    def loss(params):
        logits = model.apply(
            {**variables, "params": params}, images, train=True, rngs={"dropout": jax.random.key(2)}
        )
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1).mean()

    grads = jax.jit(jax.grad(loss))(variables["params"])
    for path in (
        ("conv1", "kernel"),
        ("layer1_0", "downsample_conv", "kernel"),
        ("layer4_0", "bn3", "scale"),
        ("attnpool", "positional_embedding"),
        ("attnpool", "q_proj", "kernel"),
        ("attnpool", "k_proj", "bias"),
        ("classifier", "kernel"),
    ):
        grad = grads
        for name in path:
            grad = grad[name]
        grad = np.asarray(grad)
        assert np.isfinite(grad).all() and np.abs(grad).max() > 0, path


def test_sown_intermediates_names_and_shapes(small_weights):
    variables = small_variables(small_weights)
    _, state = run(small_model(), variables, small_images(), train=False, mutable=(INTERMEDIATES,))
    width, side = SMALL["width"], SMALL_SIZE // 4
    expected = {
        "stem": (BATCH, side, side, width),
        "block1": (BATCH, side, side, 4 * width),
        "block2": (BATCH, side // 2, side // 2, 8 * width),
        "block3": (BATCH, side // 4, side // 4, 16 * width),
        "block4": (BATCH, side // 8, side // 8, 32 * width),
    }
    sown = {name: tuple(value[0].shape) for name, value in state[INTERMEDIATES].items()}
    assert sown == expected


def test_dropout_on_the_feature_in_training_only(small_weights):
    model = small_model(dropout_rate=0.5)
    variables = small_variables(small_weights, model)
    images = small_images()
    feature, _ = run(model, variables, images, train=False, features=True)
    dropped, _ = run(
        model, variables, images, train=True, features=True, rngs={"dropout": jax.random.key(3)}
    )
    dropped, feature = np.asarray(dropped), np.asarray(feature)
    kept = dropped != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(dropped[kept], 2 * feature[kept], rtol=1e-5)


def test_bfloat16_forward(small_weights):
    variables = small_variables(small_weights)
    cast = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), variables)
    logits = run(small_model(), cast, jnp.asarray(small_images(), jnp.bfloat16), train=False)
    reference = run(small_model(), variables, small_images(), train=False)
    assert logits.dtype == jnp.bfloat16 and np.isfinite(np.asarray(logits, np.float32)).all()
    assert relative_error(np.asarray(logits, np.float32), reference) < 0.1


def test_build_interface_and_constants():
    model = build(3, dropout_rate=0.2, freeze_batchnorm=False, input_channels=4, image_size=96)
    assert isinstance(model, CLIPResNet)
    assert (model.num_classes, model.dropout_rate, model.freeze_batchnorm) == (3, 0.2, False)
    assert (model.input_channels, model.image_size) == (4, 96)
    assert (tuple(model.layers), model.width, model.heads) == ((3, 4, 6, 3), 64, 32)
    assert clip_resnet.MEAN == (0.48145466, 0.4578275, 0.40821073)
    assert clip_resnet.STD == (0.26862954, 0.26130258, 0.27577711)
    assert clip_resnet.FEATURE_DIM == 1024 and clip_resnet.FEATURE_MAPS is True
    shapes = jax.eval_shape(
        lambda: build(7).init_with_output(
            jax.random.key(0), jnp.zeros((2, SIZE, SIZE, 3)), train=False, features=True
        )
    )
    (feature, logits), variables = shapes
    assert feature.shape == (2, clip_resnet.FEATURE_DIM) and logits.shape == (2, 7)
    assert variables["params"]["attnpool"]["positional_embedding"].shape == (50, 2048)


def test_images_that_do_not_fit_the_grid_are_refused(small_weights):
    variables = small_variables(small_weights)
    wrong = np.zeros((1, 96, 96, 3), np.float32)
    with pytest.raises(ValueError, match="image_size=64.*96x96"):
        small_model().apply(variables, wrong, train=False)
    with pytest.raises(ValueError, match="3 input channels"):
        small_model().apply(variables, np.zeros((1, 64, 64, 1), np.float32), train=False)
    with pytest.raises(ValueError, match="at least 32x32"):
        build(2, image_size=28)


def test_four_channel_network_takes_the_stem_channel_modulo_three(small_weights):
    model = small_model(input_channels=4)
    variables = small_variables(small_weights, model, channels=4)
    kernel = np.asarray(variables["params"]["conv1"]["kernel"])
    np.testing.assert_array_equal(kernel[:, :, 3], kernel[:, :, 0])
    logits = run(model, variables, small_images(channels=4), train=False)
    assert logits.shape == (BATCH, 5) and np.isfinite(np.asarray(logits)).all()


def convert_small(state_dict, image_size=SMALL_SIZE):
    return convert_clip_resnet(state_dict, image_size, **SMALL_ARCH)


def test_conversion_is_strict_and_names_the_keys(small_weights):
    missing = dict(small_weights)
    del missing["layer2.0.downsample.0.weight"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): layer2\.0\.downsample\.0\.weight"):
        convert_small(missing)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): proj"):
        convert_small({**small_weights, "proj": np.zeros((2, 2))})
    misshaped = {**small_weights, "attnpool.q_proj.weight": np.zeros((256, 255), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"attnpool\.q_proj\.weight has shape \(256, 255\), "
        r"expected \(256, 256\)",
    ):
        convert_small(misshaped)
    counters = {**small_weights, "bn1.num_batches_tracked": np.array(3)}
    assert convert_small(counters).keys() == {"params", "batch_stats"}
    with pytest.raises(
        ValueError,
        match=r"positional_embedding has 5 rows \(a 2x2 grid \+ 1, "
        r"images of 64x64\); image_size=224 needs 50 rows",
    ):
        convert_small(small_weights, image_size=224)


def test_conversion_layout_and_transposes(small_weights):
    converted = convert_small(small_weights)
    params, stats = converted["params"], converted["batch_stats"]
    np.testing.assert_array_equal(
        params["layer2_0"]["conv2"]["kernel"],
        small_weights["layer2.0.conv2.weight"].transpose(2, 3, 1, 0),
    )
    np.testing.assert_array_equal(
        params["attnpool"]["c_proj"]["kernel"], small_weights["attnpool.c_proj.weight"].T
    )
    np.testing.assert_array_equal(
        stats["layer3_0"]["downsample_bn"]["var"],
        small_weights["layer3.0.downsample.1.running_var"],
    )
    assert "classifier" not in params
    entries = clip_resnet_layout(SMALL_SIZE, **SMALL_ARCH)
    assert [e.torch_key for e in entries] == list(small_weights)


def test_full_clip_state_dict_float16_and_prefixes(small_weights):
    half = {f"visual.{k}": v.astype(np.float16) for k, v in small_weights.items()}
    text = {
        "positional_embedding": np.zeros((77, 16), np.float16),
        "token_embedding.weight": np.zeros((10, 16), np.float16),
        "transformer.resblocks.0.attn.in_proj_weight": np.zeros((48, 16), np.float16),
        "ln_final.weight": np.ones(16, np.float16),
        "text_projection": np.zeros((16, 32), np.float16),
        "logit_scale": np.array(4.6, np.float16),
    }
    for state_dict in ({**half, **text}, {f"module.{k}": v for k, v in {**half, **text}.items()}):
        converted = convert_small(state_dict)
        expected = convert_small({k: v.astype(np.float16) for k, v in small_weights.items()})
        for ours, reference in zip(
            jax.tree_util.tree_leaves(converted), jax.tree_util.tree_leaves(expected)
        ):
            assert ours.dtype == np.float32
            np.testing.assert_array_equal(ours, reference)
        assert detect_clip_resnet(state_dict)


def test_detection(small_weights):
    assert detect_clip_resnet(small_weights)
    assert not detect_clip_resnet(draw_torchvision_weights("resnet18", 0))
    vit_like = {
        "visual.class_embedding": np.zeros(8),
        "visual.conv1.weight": np.zeros((8, 3, 16, 16)),
        "visual.positional_embedding": np.zeros((197, 8)),
        "logit_scale": np.array(1.0),
    }
    assert not detect_clip_resnet(vit_like)
