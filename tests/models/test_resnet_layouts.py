"""ResNet-50 weight files of timm, Barlow Twins and MoCo v3 on our ResNet.

Parity: our ResNet-50 against timm's own ``resnet50.ram_in1k`` network on the same
seeded weights (golden file from experiments/make_timm_resnet_golden.py; no torch
here). Layouts: synthetic state dicts built from ``torchvision_layout`` with each
layout's key changes, detected or named, and the ``convert`` command on them.
"""

import os
import sys

import jax
import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.models import convert as convert_cli
from sagm_jax.models.resnet import ResNet
from sagm_jax.models.resnet_layouts import (
    RESNET_LAYOUTS,
    convert_resnet,
    detect_resnet,
    detect_resnet_layout,
    resnet_state_dict,
)
from sagm_jax.models.synthetic import draw_images, draw_torchvision_weights, weights_fingerprint
from sagm_jax.models.torchvision_weights import (
    load_weights,
    save_weights,
    weights_file_problem,
    weights_suffix,
    with_pretrained_backbone,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_timm_resnet.npz")
TOLERANCE = 1e-5  # max |ours - timm| relative to max |timm|


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as archive:
        return {key: archive[key] for key in archive.files}


def test_resnet50_matches_timm_resnet50_ram_in1k(golden):
    assert str(golden["timm_model"]) == "resnet50.ram_in1k"
    weights = draw_torchvision_weights("resnet50", int(golden["weight_seed"]))
    assert weights_fingerprint(weights) == str(golden["fingerprint"]), (
        "the drawn weights differ from those the golden file was made with; "
        "rerun experiments/make_timm_resnet_golden.py"
    )
    variables, layout = convert_resnet(weights, layout="timm")
    assert layout == "timm"
    logits_ref, features_ref = golden["logits"], golden["features"]
    batch = logits_ref.shape[0]
    images = draw_images(int(golden["image_seed"]), batch, 224).transpose(0, 2, 3, 1)
    model = ResNet(arch="resnet50", num_classes=1000)
    forward = jax.jit(lambda v, x: model.apply(v, x, train=False, features=True))
    with jax.default_matmul_precision("float32"):
        features, logits = (np.asarray(a) for a in forward(variables, images))
    assert features.shape == features_ref.shape == (batch, 2048)
    assert logits.shape == logits_ref.shape == (batch, 1000)
    for name, ours, ref in (("features", features, features_ref), ("logits", logits, logits_ref)):
        error = np.abs(ours - ref).max() / np.abs(ref).max()
        print(f"{name}: max relative error {error:.2e}")
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


# --- synthetic files of each layout ---------------------------------------------------


def _with_counters(weights):
    counters = {
        key.rsplit(".", 1)[0] + ".num_batches_tracked": np.array(7, np.int64)
        for key in weights
        if key.endswith(".running_mean")
    }
    return {**weights, **counters}


def _barlowtwins(weights):
    return {key: value for key, value in weights.items() if not key.startswith("fc.")}


def _mocov3(weights):
    """A MoCo v3 checkpoint's state_dict: base and momentum encoders (each with the
    2-layer projection MLP as fc: Linear, BN1d, ReLU, Linear, BN1d without affine) and
    the predictor."""
    backbone = _with_counters(_barlowtwins(weights))
    mlp = {
        "fc.0.weight": np.ones((64, 2048), np.float32),
        "fc.1.weight": np.ones(64, np.float32),
        "fc.1.bias": np.zeros(64, np.float32),
        "fc.1.running_mean": np.zeros(64, np.float32),
        "fc.1.running_var": np.ones(64, np.float32),
        "fc.1.num_batches_tracked": np.array(3, np.int64),
        "fc.3.weight": np.ones((16, 64), np.float32),
        "fc.4.running_mean": np.zeros(16, np.float32),
        "fc.4.running_var": np.ones(16, np.float32),
    }
    state = {}
    for key, value in {**backbone, **mlp}.items():
        state[f"module.base_encoder.{key}"] = value
        state[f"module.momentum_encoder.{key}"] = value + 1  # differs: must not be taken
    state["module.predictor.0.weight"] = np.ones((64, 16), np.float32)
    state["module.predictor.1.weight"] = np.ones(64, np.float32)
    return state


@pytest.fixture(scope="module")
def resnet18_weights():
    return draw_torchvision_weights("resnet18", seed=4)


@pytest.fixture(scope="module")
def resnet50_weights():
    return draw_torchvision_weights("resnet50", seed=5)


@pytest.mark.parametrize(
    "make, expected",
    [(_with_counters, "torchvision"), (_barlowtwins, "barlowtwins"), (_mocov3, "mocov3")],
)
def test_each_layout_is_detected_from_its_keys(resnet18_weights, make, expected):
    state = make(resnet18_weights)
    assert detect_resnet_layout(state) == expected and detect_resnet(state)
    result, layout = resnet_state_dict(state)
    assert layout == expected
    backbone = {k for k in resnet18_weights if not k.startswith("fc.")}
    assert {k for k in result if not k.endswith(".num_batches_tracked")} == (
        set(resnet18_weights) if expected == "torchvision" else backbone
    )


def test_a_timm_file_shows_torchvision_keys_and_is_read_as_timm_when_named(resnet18_weights):
    # timm's resnet50 state_dict has torchvision's keys: detected as "torchvision"
    # (the computation is the same, as the golden parity shows); named, it is "timm".
    result, layout = resnet_state_dict(resnet18_weights, layout="timm")
    assert layout == "timm" and result.keys() == resnet18_weights.keys()
    assert resnet_state_dict(resnet18_weights)[1] == "torchvision"


def test_mocov3_keeps_the_base_encoder_without_its_projection_head(resnet50_weights):
    result, layout = resnet_state_dict(_mocov3(resnet50_weights))
    assert layout == "mocov3"
    assert not any(key.startswith(("fc.", "module.")) for key in result)
    backbone = _with_counters(_barlowtwins(resnet50_weights))
    assert result.keys() == backbone.keys()
    for key in ("conv1.weight", "layer4.2.bn3.running_var", "layer2.0.downsample.0.weight"):
        np.testing.assert_array_equal(result[key], resnet50_weights[key])  # not momentum's
    variables, _ = convert_resnet(_mocov3(resnet50_weights))
    assert "classifier" not in variables["params"]
    np.testing.assert_array_equal(
        variables["params"]["conv1"]["kernel"],
        resnet50_weights["conv1.weight"].transpose(2, 3, 1, 0),
    )


def test_barlowtwins_without_fc_goes_into_a_domainbed_network(resnet18_weights):
    converted, layout = convert_resnet(_barlowtwins(resnet18_weights))
    assert layout == "barlowtwins" and "classifier" not in converted["params"]
    model = models.create("resnet18", num_classes=7)
    # The fresh variables' structure (eval_shape: no slow random initialisation), with a
    # recognisable classifier.
    shapes = jax.eval_shape(
        lambda key, x: model.init(key, x, train=False),
        jax.random.PRNGKey(0),
        np.zeros((1, 32, 32, 3), np.float32),
    )
    fresh = jax.tree.map(lambda leaf: np.full(leaf.shape, 0.25, leaf.dtype), shapes)
    merged = with_pretrained_backbone(fresh, converted)
    np.testing.assert_array_equal(
        merged["params"]["layer3_1"]["conv2"]["kernel"],
        resnet18_weights["layer3.1.conv2.weight"].transpose(2, 3, 1, 0),
    )
    np.testing.assert_array_equal(
        merged["batch_stats"]["bn1"]["mean"], resnet18_weights["bn1.running_mean"]
    )
    np.testing.assert_array_equal(  # the fresh classifier is kept
        merged["params"]["classifier"]["kernel"], fresh["params"]["classifier"]["kernel"]
    )
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(
        merged, np.ones((2, 32, 32, 3), np.float32)
    )
    assert logits.shape == (2, 7) and np.all(np.isfinite(logits))


def test_unknown_keys_are_refused_by_name():
    state = {"encoder.layers.0.weight": np.zeros((2, 2)), "head.bias": np.zeros(2)}
    assert detect_resnet_layout(state) is None and not detect_resnet(state)
    with pytest.raises(ValueError, match=r"none of the ResNet layouts.*encoder\.layers\.0\.weight"):
        resnet_state_dict(state)
    with pytest.raises(ValueError, match=r"none of the ResNet layouts.*head\.bias"):
        resnet_state_dict(state, layout="mocov3")
    with pytest.raises(ValueError, match="unknown ResNet layout 'simclr'"):
        resnet_state_dict(state, layout="simclr")


def test_a_named_layout_that_does_not_fit_is_refused(resnet18_weights):
    with pytest.raises(ValueError, match="barlowtwins .*has no fc.*fc.bias, fc.weight"):
        resnet_state_dict(resnet18_weights, layout="barlowtwins")
    with pytest.raises(ValueError, match="timm .*fc.weight and fc.bias; this one lacks them"):
        resnet_state_dict(_barlowtwins(resnet18_weights), layout="timm")


def test_strict_checks_name_the_keys_after_the_layout_rules(resnet18_weights):
    state = _mocov3(resnet18_weights)
    del state["module.base_encoder.layer2.1.bn1.bias"]
    state["module.base_encoder.layer9.0.conv1.weight"] = np.zeros((1,))
    with pytest.raises(ValueError, match=r"missing keys \(1\): layer2\.1\.bn1\.bias"):
        resnet_state_dict(state)
    barlow = _barlowtwins(resnet18_weights)
    barlow["layer1.0.conv1.weight"] = np.zeros((64, 64, 1, 1), np.float32)
    with pytest.raises(ValueError, match=r"layer1\.0\.conv1\.weight has shape \(64, 64, 1, 1\)"):
        resnet_state_dict(barlow)
    partial = dict(resnet18_weights)
    del partial["fc.bias"]  # one half of the fc: not a backbone alone
    with pytest.raises(ValueError, match=r"missing keys \(1\): fc\.bias"):
        resnet_state_dict(partial)


# --- the convert command ----------------------------------------------------------------


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        return handle.metadata()


@pytest.mark.parametrize(
    "make, layout, flag",
    [
        (_with_counters, "torchvision", None),
        (_barlowtwins, "barlowtwins", None),
        (_mocov3, "mocov3", None),
        (_with_counters, "timm", "timm"),
    ],
)
def test_convert_command_writes_torchvision_keys_with_the_layout(
    tmp_path, resnet18_weights, capsys, make, layout, flag
):
    source = tmp_path / "source.npz"
    source_sha = save_weights(make(resnet18_weights), source)
    target = tmp_path / "out.safetensors"
    convert_cli.main([str(source), str(target)] + (["--layout", flag] if flag else []))
    written, target_sha = load_weights(target)
    expected, _ = resnet_state_dict(make(resnet18_weights), layout)
    assert written.keys() == expected.keys()
    for key in ("conv1.weight", "layer4.1.bn2.running_mean"):
        np.testing.assert_array_equal(written[key], resnet18_weights[key])
    metadata = _metadata(target)
    assert metadata["layout"] == layout and metadata["source_sha256"] == source_sha
    assert metadata["arch"] == "resnet18"
    output = capsys.readouterr().out
    assert f"layout {layout} ({'named' if flag else 'detected'})" in output
    assert source_sha in output and target_sha in output
    variables, _ = convert_resnet(written)  # the written file reads back as torchvision's keys
    assert ("classifier" in variables["params"]) == (layout in ("torchvision", "timm"))


def test_convert_command_refuses_unknown_keys_by_name(tmp_path):
    source = tmp_path / "other.npz"
    save_weights({"blocks.0.attn.qkv.weight": np.zeros((6, 2), np.float32)}, source)
    target = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=r"no converter recognises.*blocks\.0\.attn\.qkv\.weight"):
        convert_cli.main([str(source), str(target)])
    with pytest.raises(ValueError, match=r"none of the ResNet layouts.*blocks\.0\.attn"):
        convert_cli.main([str(source), str(target), "--layout", "mocov3"])
    assert not target.exists()
    assert set(RESNET_LAYOUTS) <= set(convert_cli.layouts())


# --- the torch file formats: .bin (Hugging Face hub) and .pth.tar (MoCo v3) -------------


def test_torch_file_suffixes_are_recognised(tmp_path):
    assert weights_suffix("r-50-1000ep.PTH.TAR") == ".pth.tar"
    assert weights_suffix("pytorch_model.bin") == ".bin"
    assert weights_suffix("archive.tar") == ".tar"
    assert "extension '.tar'" in weights_file_problem(_write(tmp_path / "a.tar", b"PK\x03\x04"))
    bad = _write(tmp_path / "pytorch_model.bin", b"<html>not found</html>")
    assert "a .bin is a zip archive" in weights_file_problem(bad)
    pickle = _write(tmp_path / "old.pth.tar", b"\x80\x02rest")
    assert weights_file_problem(pickle) is None


def _write(path, content):
    path.write_bytes(content)
    return path


def test_moco_checkpoint_and_hub_bin_are_read_with_torch(tmp_path, resnet18_weights):
    torch = pytest.importorskip("torch")
    state = {key: torch.from_numpy(np.asarray(v)) for key, v in _mocov3(resnet18_weights).items()}
    checkpoint = {
        "epoch": 100,
        "arch": "resnet50",
        "state_dict": state,
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
    }
    torch.save(checkpoint, tmp_path / "r-50-1000ep.pth.tar")
    loaded, _ = load_weights(tmp_path / "r-50-1000ep.pth.tar")
    assert resnet_state_dict(loaded)[1] == "mocov3"
    torch.save(
        {k: torch.from_numpy(v) for k, v in resnet18_weights.items()},
        tmp_path / "pytorch_model.bin",
    )
    loaded, _ = load_weights(tmp_path / "pytorch_model.bin")
    np.testing.assert_array_equal(loaded["fc.weight"], resnet18_weights["fc.weight"])


def test_torch_file_without_torch_says_how_to_convert(tmp_path, monkeypatch):
    path = _write(tmp_path / "r-50-1000ep.pth.tar", b"PK\x03\x04")
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    with pytest.raises(ImportError, match="python -m sagm_jax.models.convert"):
        load_weights(path)


def test_convert_command_keeps_clips_image_tower_and_does_not_take_it_for_a_resnet(tmp_path):
    """CLIP's RN50 shares the ResNets' stem and block keys (conv1, layer1.0.conv1, ...):
    the command detects it by its attention pool, keeps the image tower of a whole CLIP
    model (the text tower's keys dropped) and checks it strictly at 224x224."""
    from sagm_jax.models.clip_resnet_weights import clip_resnet_layout

    tower = {f"visual.{e.torch_key}": np.zeros(e.shape, np.float16) for e in clip_resnet_layout()}
    tower["transformer.resblocks.0.ln_1.weight"] = np.ones(512, np.float16)  # text tower
    source, target = str(tmp_path / "RN50.safetensors"), str(tmp_path / "out.safetensors")
    save_weights(tower, source)
    convert_cli.main([source, target])
    written, _ = load_weights(target)
    assert sorted(written) == sorted(e.torch_key for e in clip_resnet_layout())
    del tower["visual.attnpool.c_proj.bias"]
    save_weights(tower, source)
    with pytest.raises(ValueError, match="attnpool.c_proj.bias"):
        convert_cli.main([source, target])
