"""Weight files and the strict mapping of torchvision keys onto our variables."""

import hashlib
import sys

import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.models import convert as convert_cli
from sagm_jax.models.resnet import ARCHITECTURES
from sagm_jax.models.synthetic import draw_torchvision_weights
from sagm_jax.models.torchvision_weights import torchvision_layout


@pytest.fixture(scope="module")
def resnet18_weights():
    return draw_torchvision_weights("resnet18", seed=0)


def test_layout_counts_match_torchvision():
    # torchvision's state_dict() has 122 (resnet18) and 320 (resnet50) entries, of which
    # 20 and 53 are BatchNorm num_batches_tracked counters.
    assert len(torchvision_layout("resnet18")) == 122 - 20
    assert len(torchvision_layout("resnet50")) == 320 - 53


def test_conversion_transposes_layouts(resnet18_weights):
    converted = models.convert_torchvision(resnet18_weights)
    np.testing.assert_array_equal(
        converted["params"]["conv1"]["kernel"],
        resnet18_weights["conv1.weight"].transpose(2, 3, 1, 0),
    )
    np.testing.assert_array_equal(
        converted["params"]["classifier"]["kernel"], resnet18_weights["fc.weight"].T
    )
    np.testing.assert_array_equal(
        converted["batch_stats"]["layer4_0"]["downsample_bn"]["var"],
        resnet18_weights["layer4.0.downsample.1.running_var"],
    )
    np.testing.assert_array_equal(
        converted["params"]["layer1_1"]["bn2"]["scale"], resnet18_weights["layer1.1.bn2.weight"]
    )


def test_num_batches_tracked_is_ignored(resnet18_weights):
    with_counters = dict(resnet18_weights, **{"bn1.num_batches_tracked": np.array(7)})
    models.convert_torchvision(with_counters)


def test_missing_key_is_named(resnet18_weights):
    weights = dict(resnet18_weights)
    del weights["layer3.1.bn1.running_var"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): layer3\.1\.bn1\.running_var"):
        models.convert_torchvision(weights)


def test_unexpected_key_is_named(resnet18_weights):
    weights = dict(resnet18_weights, **{"layer5.0.conv1.weight": np.zeros((1,))})
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): layer5\.0\.conv1\.weight"):
        models.convert_torchvision(weights)


def test_misshaped_key_is_named(resnet18_weights):
    weights = dict(
        resnet18_weights, **{"layer2.0.conv2.weight": np.zeros((128, 128, 1, 1), np.float32)}
    )
    with pytest.raises(
        ValueError,
        match=r"layer2\.0\.conv2\.weight has shape \(128, 128, 1, 1\), expected \(128, 128, 3, 3\)",
    ):
        models.convert_torchvision(weights)


def test_wrong_arch_names_keys(resnet18_weights):
    with pytest.raises(
        ValueError, match=r"torchvision resnet50: missing keys .*layer1\.0\.conv3\.weight"
    ):
        models.convert_torchvision(resnet18_weights, arch="resnet50")


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_round_trip_and_sha256(tmp_path, resnet18_weights, suffix):
    path = tmp_path / f"weights{suffix}"
    written_sha = models.save_weights(resnet18_weights, path)
    loaded, sha = models.load_weights(path)
    assert sha == written_sha == hashlib.sha256(path.read_bytes()).hexdigest()
    assert set(loaded) == set(resnet18_weights)
    for key, value in resnet18_weights.items():
        np.testing.assert_array_equal(loaded[key], value)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        models.load_weights(tmp_path / "nowhere.safetensors")
    other = tmp_path / "weights.ckpt"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"weights\.ckpt.*unsupported weights format '\.ckpt'"):
        models.load_weights(other)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_corrupt_file_is_a_clear_error(tmp_path, suffix):
    path = tmp_path / f"broken{suffix}"
    path.write_bytes(b"this is not a weights file")
    with pytest.raises(ValueError, match=f"broken\\{suffix}: not a readable"):
        models.load_weights(path)


def test_pth_without_torch_says_how_to_install_or_convert(tmp_path, monkeypatch):
    path = tmp_path / "resnet50-0676ba61.pth"
    path.write_bytes(b"\0" * 16)
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    with pytest.raises(ImportError) as error:
        models.load_weights(path)
    message = str(error.value)
    assert "pip install 'sagm_jax[torch]'" in message
    assert "python -m sagm_jax.models.convert" in message and str(path) in message


def test_pth_read_with_torch(tmp_path, resnet18_weights):
    torch = pytest.importorskip("torch")
    path = tmp_path / "resnet18.pth"
    torch.save({key: torch.from_numpy(value) for key, value in resnet18_weights.items()}, path)
    loaded, sha = models.load_weights(path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    np.testing.assert_array_equal(loaded["fc.weight"], resnet18_weights["fc.weight"])


def test_convert_command_writes_a_checked_file_with_provenance(tmp_path, resnet18_weights, capsys):
    source = tmp_path / "source.npz"
    source_sha = models.save_weights(resnet18_weights, source)
    target = tmp_path / "resnet18.safetensors"
    convert_cli.main([str(source), str(target)])
    loaded, target_sha = models.load_weights(target)
    assert set(loaded) == set(resnet18_weights)
    from safetensors import safe_open

    with safe_open(str(target), framework="numpy") as handle:
        assert handle.metadata()["source_sha256"] == source_sha
        assert handle.metadata()["arch"] == "resnet18"
    output = capsys.readouterr().out
    assert source_sha in output and target_sha in output


def test_convert_command_refuses_a_mismatched_state_dict(tmp_path, resnet18_weights):
    weights = dict(resnet18_weights)
    del weights["fc.bias"]
    source = tmp_path / "partial.npz"
    models.save_weights(weights, source)
    with pytest.raises(ValueError, match="missing keys .*fc.bias"):
        convert_cli.main([str(source), str(tmp_path / "out.safetensors")])
    assert not (tmp_path / "out.safetensors").exists()


def test_every_resnet_names_the_torchvision_file_it_starts_from():
    assert set(models.WEIGHTS_FILES) == set(ARCHITECTURES)
    for arch, file in models.WEIGHTS_FILES.items():
        assert file.startswith(f"{arch}-") and file.endswith(".pth")
        assert models.weights_url(arch) == f"https://download.pytorch.org/models/{file}"


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_the_format_check_takes_written_files_and_refuses_them_cut_short(tmp_path, suffix):
    # Files written by the safetensors and NumPy libraries, then cut: the cheap check
    # (first bytes, header, zip directory) must agree with the full reader.
    from sagm_jax.models.torchvision_weights import weights_file_problem

    path = tmp_path / f"w{suffix}"
    arrays = {"fc.weight": np.arange(600, dtype=np.float32).reshape(6, 100), "fc.bias": np.ones(6)}
    models.save_weights(arrays, path, metadata={"arch": "test"} if suffix != ".npz" else None)
    assert weights_file_problem(path) is None
    content = path.read_bytes()
    for cut in (len(content) - 1, len(content) // 2, 12):
        path.write_bytes(content[:cut])
        with pytest.raises(ValueError):
            models.load_weights(path)  # the full reader refuses it too
        assert weights_file_problem(path), cut


def test_a_torchscript_archive_is_read_as_its_state_dict(tmp_path):
    """OpenAI's CLIP files (RN50.pt, ViT-B-16.pt) are TorchScript archives, which
    torch.load refuses: load_weights reads them as clip.load does (torch.jit.load)."""
    torch = pytest.importorskip("torch")
    from sagm_jax.models.torchvision_weights import load_weights

    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).half()
    path = tmp_path / "RN50.pt"
    torch.jit.save(torch.jit.script(module), str(path))
    loaded, _ = load_weights(path)
    expected = module.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(loaded[key], value.numpy())
    assert loaded["0.weight"].dtype == np.float16  # converters make it float32
