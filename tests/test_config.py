"""sagm_jax.config and configs/*.py: the paper's numbers, checks, and command-line errors."""

import glob
import os
import runpy
import subprocess
import sys

import pytest

from sagm_jax.config import base_config, check_overrides, validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The paper's SAGM hyperparameters, as docs/protocol.md lists them.
PROTOCOL = {
    "pacs": ("PACS", 3e-5, 1e-4, 1e-3, 5001),
    "vlcs": ("VLCS", 1e-5, 1e-4, 1e-3, 5001),
    "office_home": ("OfficeHome", 1e-5, 1e-4, 5e-4, 5001),
    "terra_incognita": ("TerraIncognita", 1e-5, 1e-4, 1e-3, 5001),
    "domain_net": ("DomainNet", 3e-5, 1e-6, 5e-4, 15001),
}


def load(name):
    return runpy.run_path(os.path.join(REPO, "configs", f"{name}.py"))["get_config"]()


@pytest.mark.parametrize("name", sorted(PROTOCOL))
def test_dataset_configs_carry_the_papers_hyperparameters(name):
    dataset, lr, weight_decay, alpha, steps = PROTOCOL[name]
    config = load(name)
    assert (config.dataset, config.arch, config.algorithm) == (dataset, "resnet50", "sagm")
    assert (config.lr, config.weight_decay, config.alpha, config.steps) == (
        lr,
        weight_decay,
        alpha,
        steps,
    )
    assert (config.dropout, config.rho, config.batch_per_env, config.eval_every) == (
        0.5,
        0.05,
        32,
        100,
    )
    assert config.freeze_batchnorm and config.combine == "mean" and config.perturbation == "global"
    config.pretrained_weights = "resnet50.safetensors"
    validate(config)


def test_every_config_file_validates():
    files = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
    assert len(files) == 9
    for path in files:
        config = runpy.run_path(path)["get_config"]()
        if config.arch != "mnist_cnn":
            config.pretrained_weights = "none"
        validate(config)
    mnist = load("rotated_mnist")
    assert (mnist.lr, mnist.weight_decay, mnist.batch_per_env, mnist.arch) == (
        1e-3,
        0.0,
        64,
        "mnist_cnn",
    )
    assert load("colored_mnist").test_envs == (2,)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("algorithm", "adamw", "config.algorithm='adamw': expected one of erm, sam"),
        ("combine", "avg", "config.combine='avg'"),
        ("steps", 0, "config.steps=0: expected a positive integer"),
        ("dropout", 1.0, "config.dropout=1.0"),
        ("pretrained_weights", "", "config.pretrained_weights is empty"),
    ],
)
def test_validate_names_the_key(key, value, message):
    config = base_config()
    config.pretrained_weights = "weights.pth"
    config[key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(config)


def test_mixstyle_needs_a_resnet():
    config = load("rotated_digits")
    config.mixstyle = True
    with pytest.raises(ValueError, match="mixstyle=True.*mnist_cnn"):
        validate(config)


def test_unknown_override_lists_the_valid_keys():
    path = os.path.join(REPO, "configs", "rotated_digits.py")
    check_overrides([f"--config={path}", "--config.lr=0.1", "--config.test_envs=1"])
    with pytest.raises(SystemExit, match=r"--config.learning_rate: no such key.*Valid keys: .*lr"):
        check_overrides([f"--config={path}", "--config.learning_rate=0.1"])


def test_main_reports_an_unknown_key_and_exits(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sagm_jax.main",
            f"--config={REPO}/configs/rotated_digits.py",
            f"--workdir={tmp_path}",
            "--config.stepz=3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode != 0
    assert "--config.stepz: no such key" in result.stderr and "steps" in result.stderr
    assert not os.listdir(tmp_path)
