"""The one config system: the base ml-collections config, and its checks.

Every file in ``configs/`` starts from :func:`base_config` and overrides the
fields its dataset needs; ``--config.key=value`` overrides on the command line.
:func:`validate` rejects values the run cannot honour, naming the key, and
:func:`check_overrides` rejects an override of a key that does not exist,
listing the valid keys (ml-collections alone answers with a bare AttributeError).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Sequence

import ml_collections

from sagm_jax.optimizers import ALGORITHMS


def base_config() -> ml_collections.ConfigDict:
    """Fields shared by every run; DomainBed's and the paper's defaults where they exist."""
    c = ml_collections.ConfigDict()
    # Data (see sagm_jax.data): `data_dir` holds the dataset folders.
    c.dataset = "RotatedDigits"
    c.data_dir = ""
    c.test_envs = (0,)  # held-out environments of one run
    c.all_test_envs = False  # one run per environment, like SAGM's train_all
    c.trial_seed = 0  # picks the split (DomainBed's trial_seed)
    c.seed = 0  # picks initialization, batches, dropout, augmentation
    c.holdout_fraction = 0.2
    c.split = "domainbed"  # or "in_domain": 60/20/20 of the training domains (Table 2)
    c.batch_per_env = 32
    c.eval_batch_size = 128
    c.augment_validation = False  # DomainBed's old default augmented it
    c.skip_bad_files = False
    c.image_size = 224
    # Model (see sagm_jax.models).
    c.arch = "resnet50"
    c.pretrained_weights = ""  # torchvision .pth/.safetensors/.npz; "none" = from scratch
    c.dropout = 0.5
    c.freeze_batchnorm = True
    c.mixstyle = False
    c.mixstyle_after = (1, 2, 3)
    c.cnn_widths = (64, 128, 128, 128)  # the MNIST CNN's conv widths (DomainBed's)
    # Optimizer (see sagm_jax.optimizers.paper_optimizer).
    c.algorithm = "sagm"
    c.lr = 3e-5
    c.weight_decay = 1e-4
    c.rho = 0.05
    c.alpha = 1e-3  # SAGM's alpha; GSAM uses it as its alpha too
    c.combine = "mean"  # SAGM: "mean" (the released code) or "sum" (the paper's text)
    c.adaptive = False
    c.perturbation = "global"  # or "per_device" (m-sharpness, a different algorithm)
    c.shared_dropout = False  # reuse the clean pass's dropout mask in the perturbed pass
    c.compute_dtype = "float32"  # or "bfloat16" on accelerators
    c.num_devices = 0  # devices of the batch mesh; 0 = every device of every host
    # Schedule.
    c.steps = 5001
    c.eval_every = 100
    c.log_every = 10
    c.checkpoint = True
    return c


# The paper's SAGM hyperparameters per dataset (ResNet-50, dropout 0.5, rho 0.05).
PAPER_HPARAMS = {
    "PACS": dict(lr=3e-5, weight_decay=1e-4, alpha=1e-3, steps=5001),
    "VLCS": dict(lr=1e-5, weight_decay=1e-4, alpha=1e-3, steps=5001),
    "OfficeHome": dict(lr=1e-5, weight_decay=1e-4, alpha=5e-4, steps=5001),
    "TerraIncognita": dict(lr=1e-5, weight_decay=1e-4, alpha=1e-3, steps=5001),
    "DomainNet": dict(lr=3e-5, weight_decay=1e-6, alpha=5e-4, steps=15001),
}


def paper_config(dataset: str) -> ml_collections.ConfigDict:
    """:func:`base_config` with the paper's SAGM hyperparameters for ``dataset``."""
    config = base_config()
    config.dataset = dataset
    config.arch, config.dropout, config.rho = "resnet50", 0.5, 0.05
    for key, value in PAPER_HPARAMS[dataset].items():
        config[key] = value
    return config


def mnist_config(dataset: str) -> ml_collections.ConfigDict:
    """DomainBed's MNIST settings: its CNN, lr 1e-3, batch 64 per environment, no
    weight decay, no dropout."""
    config = base_config()
    config.dataset = dataset
    config.arch, config.lr, config.weight_decay, config.dropout = "mnist_cnn", 1e-3, 0.0, 0.0
    config.batch_per_env = 64
    return config


_CHOICES = {
    "algorithm": ALGORITHMS,
    "combine": ("mean", "sum"),
    "perturbation": ("global", "per_device"),
    "split": ("domainbed", "in_domain"),
    "compute_dtype": ("float32", "bfloat16"),
    "arch": ("resnet18", "resnet50", "mnist_cnn"),
}


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first key whose value a run cannot use."""
    for key, choices in _CHOICES.items():
        if config[key] not in choices:
            raise ValueError(f"config.{key}={config[key]!r}: expected one of {', '.join(choices)}.")
    if int(config.num_devices) < 0:
        raise ValueError(f"config.num_devices={config.num_devices!r}: expected 0 (all) or more.")
    for key in ("steps", "eval_every", "log_every", "batch_per_env", "eval_batch_size"):
        if int(config[key]) < 1:
            raise ValueError(f"config.{key}={config[key]!r}: expected a positive integer.")
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"config.dropout={config.dropout!r}: expected a value in [0, 1).")
    if not 0.0 < config.holdout_fraction < 1.0:
        raise ValueError(f"config.holdout_fraction={config.holdout_fraction!r}: expected (0, 1).")
    if config.mixstyle and config.arch == "mnist_cnn":
        raise ValueError(
            "config.mixstyle=True: MixStyle sits between ResNet stages; "
            "config.arch='mnist_cnn' has none."
        )
    if config.arch != "mnist_cnn" and not config.pretrained_weights:
        raise ValueError(
            f"config.pretrained_weights is empty for config.arch={config.arch!r}. The paper "
            "starts from torchvision's IMAGENET1K_V1 weights: download them "
            "(resnet50-0676ba61.pth / resnet18-f37072fd.pth from download.pytorch.org/models/), "
            "optionally convert once with `python -m sagm_jax.models.convert in.pth out.safetensors`, "
            "and pass --config.pretrained_weights=PATH; --config.pretrained_weights=none "
            "trains from scratch (not the paper's setting)."
        )


def _flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            keys += _flat_keys(value, prefix + key + ".")
    return keys


def check_overrides(argv: Sequence[str], flag: str = "config") -> None:
    """Exits with a message listing the valid keys if ``--config.KEY=`` names no key.

    Loads the config file named by ``--config=PATH`` the way ml-collections does
    (its ``get_config()``), before absl parses the flags.
    """
    path = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")), None)
    overrides = [m.group(1) for a in argv if (m := re.match(rf"--{flag}\.([\w.]+)(=|$)", a))]
    if path is None or not overrides:
        return
    spec = importlib.util.spec_from_file_location("_config_file", path.split(":", 1)[0])
    if spec is None or spec.loader is None:
        raise SystemExit(
            f"--{flag}={path}: no such config file (expected a .py with get_config())."
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    valid = _flat_keys(module.get_config())
    for key in overrides:
        if key not in valid:
            raise SystemExit(
                f"--{flag}.{key}: no such key in {path}. Valid keys: {', '.join(sorted(valid))}."
            )
