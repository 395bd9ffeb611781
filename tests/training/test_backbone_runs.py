"""The backbones end to end: SAGM + MIRO + SWAD on the ViTs, a pack of two SAGM runs, and
``load_run``; CLIP's input normalisation; pretrained weights through a run's start.

Each backbone runs as a reduced-size variant (``Backbone.options``: the published
network's code with fewer and narrower blocks) on a tiny image folder, so that a run
compiles and trains in seconds on the CPU; the published sizes are checked against
their reference implementations in tests/models (the parity goldens), and
``experiments/run_every_backbone.py`` trains them at full size.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import tiny_folder_config, write_image_tree

from sagm_jax import models
from sagm_jax.models import backbones
from sagm_jax.training import loading, packed, train

# name -> (published backbone, builder sizes, image size)
TINY = {
    "tiny_clip_resnet": ("clip_resnet50", dict(layers=(1, 1, 1, 1), width=8, heads=2,
                                                output_dim=16), 32),
    "tiny_regnet": ("swag_regnety_16gf", dict(stem_width=8, depths=(1, 1, 1, 1),
                                              widths=(8, 16, 24, 32), group_widths=(8, 8, 8, 8),
                                              bottleneck_multipliers=(1.0,) * 4), 32),
    "tiny_clip_vit": ("clip_vit-b16", dict(width=32, depth=4, heads=2, output_dim=16), 32),
    "tiny_dinov2": ("dinov2_vitb14", dict(width=32, depth=4, heads=2), 28),
}


@pytest.fixture(autouse=True)
def tiny_backbones(monkeypatch):
    for name, (published, sizes, _) in TINY.items():
        backbone = dataclasses.replace(backbones.BACKBONES[published], name=name,
                                       options=tuple(sizes.items()))
        monkeypatch.setitem(backbones.BACKBONES, name, backbone)


def _config(tmp_path, arch, **overrides):
    settings = dict(arch=arch, image_size=TINY[arch][2], steps=3, eval_every=1, test_envs=(1,),
                    algorithm="sagm", lr=1e-4, num_devices=1)
    return tiny_folder_config(tmp_path, **{**settings, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tiny_clip_vit", "tiny_dinov2"])
def test_a_backbone_trains_with_sagm_miro_and_swad(tmp_path, arch):
    """The ViTs, whose MIRO layers are token sequences. The CNNs sow NHWC maps, as the
    MNIST CNN of MIRO's runs in tests/methods does; their sown layers are checked in
    tests/models, and experiments/run_every_backbone.py trains every backbone so at
    full size. DINOv2's run also trains its attention layers only
    (DomainBed HEAD's ``vit_attn_tune``): every other backbone parameter ends
    bit-identical to its start, while the attention layers, the classifier and MIRO's
    encoders move."""
    write_image_tree(tmp_path / "data", n=3)
    config = _config(tmp_path, arch, objective="miro", swad=True, swad_eval_every=1,
                     swad_n_converge=1, swad_n_tolerance=2, swad_tolerance_ratio=100.0,
                     attention_only=arch == "tiny_dinov2", weight_decay=1e-2)
    _, start = train.open_run(config)  # the run's variables at step 0
    records = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["reg_loss"]) for r in records)
    # MIRO's encoders sized by the backbone's sown features: its five layers (stem and
    # four blocks), the embedding or channel axis last.
    _, variables, _ = loading.load_run(str(tmp_path / "run"), "latest")
    encoders = variables["params"]["method"]["variance"]
    assert sorted(encoders) == ["block1", "block2", "block3", "block4", "stem"]
    moved = {jax.tree_util.keystr(path): not np.array_equal(a, b) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(start["params"]), jax.tree.leaves(variables["params"]))}
    trains = {path: not config.attention_only or "attn" in path
              or path.startswith(("['classifier']", "['method']")) for path in moved}
    assert moved == trains
    model, swad_variables, record = loading.load_run(str(tmp_path / "run"), "swad")
    images = jnp.asarray(np.random.default_rng(0).normal(size=(2, *[TINY[arch][2]] * 2, 3)),
                         jnp.float32)
    assert model.apply(swad_variables, images, train=False).shape == (2, 2)
    assert record["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tiny_dinov2"])
def test_a_backbone_trains_in_a_pack_of_two(tmp_path, arch):
    """Two SAGM runs of one backbone (two seeds, two learning rates, two dropouts) as one
    program; that a pack's runs record what they record alone is tests/training/
    test_packed.py's, whatever the network (experiments/run_every_backbone.py packs
    every backbone at full size)."""
    write_image_tree(tmp_path / "data", n=3)
    configs = [_config(tmp_path, arch, seed=0), _config(tmp_path, arch, seed=1, lr=3e-4,
                                                         dropout=0.1)]
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    records = packed.train_pack(configs, dirs)
    assert [[r["step"] for r in run] for run in records] == [[0, 1, 2]] * 2
    assert records[0][-1]["loss"] != records[1][-1]["loss"]
    for workdir in dirs:
        model, variables, record = loading.load_run(workdir, "latest")
        assert record["step"] == 2 and "classifier" in variables["params"]


def test_clip_backbones_see_clips_normalisation_of_the_same_image():
    """A folder's images arrive normalised with ImageNet's mean and std; a CLIP backbone
    maps them to CLIP's: the logits equal those of the same network fed CLIP's own
    preprocessing of the uint8 image (open_clip's ``OPENAI_DATASET_MEAN``/``STD``)."""
    pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype(np.float32) / 255
    imagenet = (pixels - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    clip = ((pixels - np.array([0.48145466, 0.4578275, 0.40821073]))
            / np.array([0.26862954, 0.26130258, 0.27577711]))
    mapped = models.create("tiny_clip_resnet", 3, image_size=32, imagenet_inputs=True)
    plain = models.create("tiny_clip_resnet", 3, image_size=32)
    variables = jax.jit(lambda k: plain.init(k, jnp.zeros((1, 32, 32, 3)), train=False))(
        jax.random.key(0))
    got = jax.jit(lambda x: mapped.apply(variables, x, train=False))(jnp.float32(imagenet))
    want = jax.jit(lambda x: plain.apply(variables, x, train=False))(jnp.float32(clip))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # ImageNet-normalised backbones are left as they are.
    assert type(models.create("tiny_regnet", 3, image_size=32, imagenet_inputs=True)) is type(
        models.create("tiny_regnet", 3, image_size=32))


def test_a_run_starts_from_a_backbones_weight_file(tmp_path):
    """config.pretrained_weights of a DINOv2 hub-layout file (float16, as published
    checkpoints may be): the run's backbone holds the file's weights (torch Linear [out,
    in] as our [in, out] kernel), its fresh classifier is kept, its position table is
    resampled to the run's grid, and the run records the file's SHA-256."""
    from sagm_jax.config import base_config
    from sagm_jax.models.synthetic import draw_dinov2_weights

    weights = {k: v.astype(np.float16) for k, v in draw_dinov2_weights(
        0, width=32, depth=4, checkpoint_grid=5).items()}
    path = str(tmp_path / "dinov2.safetensors")
    models.save_weights(weights, path)
    config = base_config()
    config.update(arch="tiny_dinov2", pretrained_weights=path, dropout=0.0)
    model, variables, info = models.from_config(config, 3, (28, 28, 3), jax.random.key(0),
                                                imagenet_inputs=True)
    params = variables["params"]
    np.testing.assert_array_equal(params["blocks_2"]["attn"]["qkv"]["kernel"],
                                  weights["blocks.2.attn.qkv.weight"].astype(np.float32).T)
    assert params["pos_embedding"].shape == (1 + 2 * 2, 32)
    assert params["classifier"]["kernel"].shape == (32 * 5, 3)
    assert info["sha256"] == models.file_sha256(path)
