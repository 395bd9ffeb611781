"""CLIP ViT-B/16 and DINOv2 ViT-B/14 (sagm_jax.models.vit, vit_weights).

Parity: the golden file from experiments/make_vit_golden.py holds open_clip's
``VisionTransformer`` outputs (CLIP) and transformers' ``Dinov2Model`` outputs with
DINOv2's own position resampling (DINOv2), on weights and images regenerated here from
sagm_jax.models.synthetic; no torch is needed. One full-size forward per network; the
other checks run on reduced networks (width 64, 4 blocks, 4 heads, 8-pixel patches,
32-pixel images).
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax.models import synthetic, vit, vit_weights
from sagm_jax.models.resnet import INTERMEDIATES
from sagm_jax.models.torchvision_weights import with_pretrained_backbone

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_vit.npz")
TOLERANCE = 1e-5  # max |ours - reference| relative to max |reference|
RESAMPLING_TOLERANCE = 1e-6
CLASSES = 5
SMALL_SIZE = 32
SMALL = {"patch_size": 8, "width": 64, "depth": 4, "heads": 4}
SMALL_CLIP_OUTPUT = 16
SMALL_DINOV2_CHECKPOINT_GRID = 6  # resampled to the model's 4x4 grid
MIRO_NAMES = ("stem", "block1", "block2", "block3", "block4")


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as archive:
        return {key: archive[key] for key in archive.files}


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - reference).max() / np.abs(reference).max())


def small_clip(**changes):
    return vit.build_clip_vit_b16(CLASSES, image_size=SMALL_SIZE, **SMALL,
                                  output_dim=SMALL_CLIP_OUTPUT, **changes)


def small_dinov2(**changes):
    return vit.build_dinov2_vit_b14(CLASSES, image_size=SMALL_SIZE, **SMALL, **changes)


def small_clip_weights(seed=7, image_size=SMALL_SIZE):
    return synthetic.draw_clip_vit_weights(
        seed, image_size, **SMALL_LAYOUT, output_dim=SMALL_CLIP_OUTPUT
    )


def small_dinov2_weights(seed=8):
    return synthetic.draw_dinov2_weights(
        seed, **SMALL_LAYOUT, checkpoint_grid=SMALL_DINOV2_CHECKPOINT_GRID
    )


SMALL_LAYOUT = {"patch_size": 8, "width": 64, "depth": 4}


def init(model, x, seed=0):
    """The model's variables (jitted: an eager init dispatches every op one by one)."""
    return jax.jit(lambda key: model.init(key, x, train=False))(jax.random.key(seed))


def fresh_variables(model, x):
    """Zero variables of the model's shapes, traced but not compiled."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def images(batch=2, size=SMALL_SIZE, seed=0, channels=3):
    return jax.random.normal(jax.random.key(seed), (batch, size, size, channels))


NETWORKS = {
    "clip": (vit.build_clip_vit_b16, synthetic.draw_clip_vit_weights,
             vit_weights.convert_clip_vit, "clip_vit_b16", vit.CLIP_FEATURE_DIM),
    "dinov2": (vit.build_dinov2_vit_b14, synthetic.draw_dinov2_weights,
               vit_weights.convert_dinov2, "dinov2_vit_b14", vit.DINOV2_FEATURE_DIM),
}


@pytest.mark.parametrize("network", ["clip", "dinov2"])
def test_feature_and_intermediates_match_reference(network, golden):
    build, draw, convert, seed_name, feature_dim = NETWORKS[network]
    weights = draw(synthetic.VIT_WEIGHT_SEEDS[seed_name])
    assert synthetic.weights_fingerprint(weights) == str(golden[f"{network}_fingerprint"]), (
        "the drawn weights differ from those the golden file was made with "
        "(NumPy's generator changed?); rerun experiments/make_vit_golden.py"
    )
    model = build(CLASSES)
    fresh = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)),
                                              train=False))
    variables = with_pretrained_backbone(
        jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), fresh), convert(weights)
    )
    x = synthetic.draw_images(synthetic.VIT_IMAGE_SEED, synthetic.VIT_BATCH, synthetic.VIT_SIZE)
    forward = jax.jit(lambda v, x: model.apply(v, x, train=False, features=True,
                                               mutable=[INTERMEDIATES]))
    with jax.default_matmul_precision("float32"):
        (feature, logits), state = forward(variables, x.transpose(0, 2, 3, 1))
    assert feature.shape == golden[f"{network}_feature"].shape == (2, feature_dim)
    assert logits.shape == (2, CLASSES)
    errors = {"feature": relative_error(feature, golden[f"{network}_feature"])}
    for name in MIRO_NAMES:
        (array,) = state[INTERMEDIATES][name]
        assert array.shape == tuple(golden[f"{network}_{name}_shape"])
        tokens = np.asarray(array, np.float64).reshape(2, -1, array.shape[-1])
        errors[f"{name} mean"] = relative_error(tokens.mean(1), golden[f"{network}_{name}_mean"])
        errors[f"{name} norms"] = relative_error(
            np.linalg.norm(tokens, axis=-1), golden[f"{network}_{name}_norms"]
        )
    print(f"{network}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < TOLERANCE, errors


def test_dinov2_resampling_matches_torch_interpolate(golden):
    table = synthetic.draw_pos_table(synthetic.VIT_POS_SEED, 37, synthetic.VIT_POS_WIDTH)
    for grid in synthetic.VIT_POS_GRIDS:
        ours = vit_weights.resample_dinov2_pos_embed(table, grid)
        reference = golden[f"pos_resampled_{grid}"]
        assert ours.shape == reference.shape == (1, grid * grid + 1, synthetic.VIT_POS_WIDTH)
        error = relative_error(ours, reference)
        print(f"37 -> {grid}: relative error {error:.1e}")
        assert error < RESAMPLING_TOLERANCE, (grid, error)
    # DINOv2 uses the table as it is when the grids agree.
    np.testing.assert_array_equal(vit_weights.resample_dinov2_pos_embed(table, 37), table)


@pytest.mark.parametrize("network", ["clip", "dinov2"])
def test_attention_parameters_are_the_references(network, golden):
    """``'attn' in path`` picks our parameters of the reference's ``'attn' in name``
    (DomainBed's ``vit_attn_tune``)."""
    build, _, _, _, _ = NETWORKS[network]
    layout = (vit_weights.clip_vit_layout() if network == "clip" else vit_weights.dinov2_layout())
    reference = set(golden[f"{network}_attn_names"].tolist())
    assert len(reference) == 48  # 12 blocks x (fused qkv, output projection) x (weight, bias)
    assert {e.torch_key for e in layout if "attn" in e.torch_key} == reference
    for entry in layout:
        assert ("attn" in entry.torch_key) == ("attn" in "/".join(entry.path)), entry
    shapes = jax.eval_shape(lambda: build(CLASSES).init(
        jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False))
    paths = ["/".join(str(k.key) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(shapes["params"])[0]]
    assert len([p for p in paths if "attn" in p]) == len(reference)
    assert "blocks_3/attn/qkv/kernel" in paths


def test_miro_blocks():
    assert vit.miro_blocks(12) == (2, 5, 8, 11)
    assert vit.miro_blocks(4) == (0, 1, 2, 3)


def small_variables(model, network):
    """The reduced network's variables: its drawn checkpoint converted, a random classifier
    (no init to compile)."""
    fresh = fresh_variables(model, images())
    if network == "clip":
        converted = vit_weights.convert_clip_vit(small_clip_weights(), image_size=SMALL_SIZE)
    else:
        converted = vit_weights.convert_dinov2(small_dinov2_weights(), image_size=SMALL_SIZE)
    variables = with_pretrained_backbone(fresh, converted)
    rng = np.random.default_rng(0)
    variables["params"]["classifier"] = jax.tree_util.tree_map(
        lambda a: rng.standard_normal(a.shape).astype(np.float32), fresh["params"]["classifier"])
    return variables


@pytest.mark.parametrize("network", ["clip", "dinov2"])
def test_small_network_modes_gradient_and_intermediates(network):
    model = small_clip(dropout_rate=0.5) if network == "clip" else small_dinov2(dropout_rate=0.5)
    feature_dim = SMALL_CLIP_OUTPUT if network == "clip" else 5 * SMALL["width"]
    x = images()
    variables = small_variables(model, network)
    assert set(variables) == {"params"}
    evaluate = jax.jit(lambda v: model.apply(v, x, train=False, features=True,
                                             mutable=INTERMEDIATES))
    (feature, logits), state = evaluate(variables)
    assert feature.shape == (2, feature_dim) and logits.shape == (2, CLASSES)
    grid, length = SMALL_SIZE // SMALL["patch_size"], (SMALL_SIZE // SMALL["patch_size"]) ** 2 + 1
    shapes = {name: value[0].shape for name, value in state[INTERMEDIATES].items()}
    assert shapes == {"stem": (2, grid, grid, SMALL["width"]),
                      **{f"block{k}": (2, length, SMALL["width"]) for k in range(1, 5)}}

    def loss(params):
        dropped, out = model.apply({"params": params}, x, train=True, features=True,
                                   rngs={"dropout": jax.random.key(3)})
        return jnp.mean(jax.nn.log_softmax(out)[:, 0]), dropped

    grads, dropped = jax.jit(jax.grad(loss, has_aux=True))(variables["params"])
    # Training differs only by the head's dropout: the kept entries are the evaluation
    # feature's, scaled by 1 / (1 - rate).
    kept = np.asarray(dropped) != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_allclose(np.asarray(dropped)[kept], 2 * np.asarray(feature)[kept],
                               rtol=1e-5, atol=1e-6)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
    for path in (("conv1", "kernel"), ("blocks_0", "attn", "qkv", "kernel"), ("pos_embedding",)):
        grad = grads
        for name in path:
            grad = grad[name]
        assert np.abs(grad).max() > 0, path


@pytest.mark.parametrize("network", ["clip", "dinov2"])
def test_converted_weights_load_into_the_network(network):
    model = small_clip() if network == "clip" else small_dinov2()
    weights = small_clip_weights() if network == "clip" else small_dinov2_weights()
    convert = vit_weights.convert_clip_vit if network == "clip" else vit_weights.convert_dinov2
    converted = convert(weights, image_size=SMALL_SIZE)
    fresh = fresh_variables(model, images())
    loaded = with_pretrained_backbone(fresh, converted)
    assert np.array_equal(loaded["params"]["classifier"]["kernel"],
                          fresh["params"]["classifier"]["kernel"])
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(loaded, images())
    assert np.all(np.isfinite(logits))
    if network == "dinov2":
        assert "mask_token" not in converted["params"]
        expected = vit_weights.resample_dinov2_pos_embed(weights["pos_embed"], 4)[0]
        np.testing.assert_array_equal(converted["params"]["pos_embedding"], expected)
        assert converted["params"]["pos_embedding"].shape == (17, SMALL["width"])


def test_clip_accepts_a_whole_model_in_float16_and_prefixes():
    weights = small_clip_weights()
    half = {f"visual.{k}": v.astype(np.float16) for k, v in weights.items()}
    # Text-tower keys of a whole CLIP model are ignored.
    half.update({"token_embedding.weight": np.zeros((10, 8), np.float16),
                 "transformer.resblocks.0.attn.in_proj_weight": np.zeros((24, 8), np.float16),
                 "logit_scale": np.zeros((), np.float16)})
    converted = vit_weights.convert_clip_vit(half, image_size=SMALL_SIZE)
    rounded = vit_weights.convert_clip_vit(
        {k: v.astype(np.float16) for k, v in weights.items()}, image_size=SMALL_SIZE)
    for a, b in zip(jax.tree_util.tree_leaves(converted), jax.tree_util.tree_leaves(rounded)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    module = vit_weights.convert_clip_vit({f"module.{k}": v for k, v in weights.items()},
                                          image_size=SMALL_SIZE)
    np.testing.assert_array_equal(module["params"]["proj"], weights["proj"])


@pytest.mark.parametrize("network", ["clip", "dinov2"])
def test_conversion_is_strict_and_names_the_keys(network):
    weights = small_clip_weights() if network == "clip" else small_dinov2_weights()
    convert = vit_weights.convert_clip_vit if network == "clip" else vit_weights.convert_dinov2
    norm = "transformer.resblocks.1.ln_2.bias" if network == "clip" else "blocks.1.norm2.bias"
    missing = {k: v for k, v in weights.items() if k != norm}
    with pytest.raises(ValueError, match=f"missing keys.*{norm}"):
        convert(missing, image_size=SMALL_SIZE)
    with pytest.raises(ValueError, match="unexpected keys.*head.weight"):
        convert({**weights, "head.weight": np.zeros((3, 3))}, image_size=SMALL_SIZE)
    qkv = ("transformer.resblocks.2.attn.in_proj_weight" if network == "clip"
           else "blocks.2.attn.qkv.weight")
    with pytest.raises(ValueError, match=f"mis-shaped keys.*{qkv} has shape \\(64, 64\\), "
                                         f"expected \\(192, 64\\)"):
        convert({**weights, qkv: np.zeros((64, 64))}, image_size=SMALL_SIZE)


def test_clip_checkpoint_at_another_image_size_is_refused():
    weights = small_clip_weights(image_size=SMALL_SIZE)  # 4x4 grid, 17 rows
    with pytest.raises(ValueError, match="17 rows, a 4x4 grid.*image_size 64.*build the model "
                                         "at image_size 32"):
        vit_weights.convert_clip_vit(weights, image_size=64)


def test_dinov2_mask_token_is_optional():
    weights = small_dinov2_weights()
    without = {k: v for k, v in weights.items() if k != "mask_token"}
    a = vit_weights.convert_dinov2(weights, image_size=SMALL_SIZE)
    b = vit_weights.convert_dinov2(without, image_size=SMALL_SIZE)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_detection():
    clip, dinov2 = small_clip_weights(), small_dinov2_weights()
    whole_clip = {f"visual.{k}": v for k, v in clip.items()} | {"logit_scale": np.zeros(())}
    resnet = synthetic.draw_torchvision_weights("resnet18", 0)
    assert vit_weights.detect_clip_vit(clip) and vit_weights.detect_clip_vit(whole_clip)
    assert vit_weights.detect_dinov2(dinov2)
    assert vit_weights.detect_dinov2({f"module.{k}": v for k, v in dinov2.items()})
    for other in (dinov2, resnet):
        assert not vit_weights.detect_clip_vit(other)
    for other in (clip, whole_clip, resnet):
        assert not vit_weights.detect_dinov2(other)


def test_inputs_are_checked():
    model = small_clip()
    variables = init(model, images())
    with pytest.raises(ValueError, match="built for image_size 32 .*4x4 grid"):
        model.apply(variables, images(size=48), train=False)
    with pytest.raises(ValueError, match="3 input channels"):
        model.apply(variables, images(channels=1), train=False)
    with pytest.raises(ValueError, match="3-channel images"):
        vit.build_dinov2_vit_b14(CLASSES, input_channels=4)
    with pytest.raises(ValueError, match="at least one 14-pixel patch"):
        vit.build_dinov2_vit_b14(CLASSES, image_size=10)
    with pytest.raises(ValueError, match="last 4 blocks"):
        init(small_dinov2().clone(depth=2), images())


def test_clip_with_other_input_channels_takes_the_stem_channels_modulo_3():
    """ARM's extra channel: the pretrained patch kernel's channel i % 3 (DomainBed's rule),
    through ``with_pretrained_backbone`` (the kernel is ``conv1``, as the ResNets')."""
    model = small_clip(input_channels=4)
    fresh = fresh_variables(model, images(channels=4))
    converted = vit_weights.convert_clip_vit(small_clip_weights(), image_size=SMALL_SIZE)
    loaded = with_pretrained_backbone(fresh, converted)
    kernel = converted["params"]["conv1"]["kernel"]
    np.testing.assert_array_equal(loaded["params"]["conv1"]["kernel"][:, :, 3], kernel[:, :, 0])


def test_constants():
    assert (vit.CLIP_FEATURE_DIM, vit.DINOV2_FEATURE_DIM) == (512, 3840)
    assert not vit.CLIP_FEATURE_MAPS and not vit.DINOV2_FEATURE_MAPS
    assert len(vit.CLIP_MEAN) == len(vit.CLIP_STD) == len(vit.DINOV2_MEAN) == 3
    assert isinstance(vit.build_clip_vit_b16(3), nn.Module)


@pytest.mark.parametrize("network", ["clip", "dinov2"])
def test_bfloat16_forward(network):
    """The train step's bfloat16 mode casts parameters and images: the network follows."""
    model = small_clip() if network == "clip" else small_dinov2()
    variables = small_variables(model, network)
    to_bf16 = lambda tree: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), tree)
    forward = jax.jit(lambda v, x: model.apply(v, x, train=False, features=True)[0])
    full = np.asarray(forward(variables, images()))
    half = forward(to_bf16(variables), to_bf16(images()))
    assert half.dtype == jnp.bfloat16
    error = relative_error(np.asarray(half, np.float32), full)
    print(f"{network} bfloat16: relative error {error:.1e}")
    assert error < 0.1, error
