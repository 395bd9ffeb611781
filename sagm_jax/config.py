"""The one config system: every field (:data:`FIELDS`: key, default, meaning), the base
ml-collections config built from it, the paper's hyperparameters, and the checks.

Every file in ``configs/`` starts from :func:`base_config` and overrides the
fields its dataset needs; ``--config.key=value`` overrides on the command line.
:func:`config_problems` lists every value the run cannot honour, naming the key
(:func:`validate` raises them), and :func:`check_overrides` rejects an override of
a key that does not exist, listing the valid keys (ml-collections alone answers
with a bare AttributeError).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Sequence

import ml_collections

from sagm_jax.optimizers import ALGORITHMS


# The one definition of every config field: (key, default, meaning), by section.
# base_config() builds the ConfigDict from it, and `python -m sagm_jax.main --help`
# prints it; DomainBed's and the paper's defaults where they exist.
FIELDS: dict[str, tuple[tuple[str, object, str], ...]] = {
    "data (see sagm_jax.data)": (
        (
            "dataset",
            "RotatedDigits",
            "PACS, VLCS, OfficeHome, TerraIncognita, DomainNet, RotatedMNIST, ColoredMNIST, "
            "RotatedDigits (offline), or ImageFolder (your own DATA_DIR/<domain>/<class>/<image>)",
        ),
        ("data_dir", "", "folder holding the dataset folders (PACS/, VLCS/, ...); see the README"),
        ("test_envs", (0,), "held-out environments of one run"),
        ("all_test_envs", False, "one run per environment, then the table (SAGM's train_all)"),
        ("trial_seed", 0, "picks the split (DomainBed's trial_seed)"),
        ("seed", 0, "picks initialization, batches, dropout, augmentation"),
        ("holdout_fraction", 0.2, "the 'out' (validation) share of each environment"),
        (
            "split",
            "domainbed",
            "'domainbed' (80/20) or 'in_domain' (60/20/20, the paper's Table 2)",
        ),
        ("batch_per_env", 32, "training examples per training environment and step"),
        ("eval_batch_size", 128, "examples per evaluation batch"),
        ("augment_validation", False, "augment the 'out' splits too (DomainBed's old default)"),
        ("skip_bad_files", False, "report and skip undecodable images instead of failing"),
        ("image_size", 224, "side of the model input for image folders"),
        (
            "input",
            "device",
            '"device": decode once, augment on the accelerator; "tf": tf.data on the host',
        ),
        (
            "image_store",
            "auto",
            '"cache" (decoded store on disk), "stream" (decode per use), "auto"',
        ),
        (
            "store_short_side",
            320,
            "stored images' shorter side is capped at this (every crop >= 224)",
        ),
        ("store_budget_gb", 32.0, '"auto" streams when the estimated store is larger'),
        (
            "cache_dir",
            "",
            'decoded stores and checks; "" = $SAGM_JAX_CACHE or ~/.cache/sagm_jax',
        ),
    ),
    "model (see sagm_jax.models)": (
        ("arch", "resnet50", "resnet50, resnet18 or mnist_cnn"),
        (
            "pretrained_weights",
            "",
            "torchvision ImageNet weights (.pth/.safetensors/.npz); 'none' = from scratch",
        ),
        ("dropout", 0.5, "dropout on the pooled feature"),
        ("freeze_batchnorm", True, "BatchNorm uses its running statistics and never updates them"),
        ("mixstyle", False, "MixStyle after the ResNet stages mixstyle_after (SAGM + MixStyle)"),
        ("mixstyle_after", (1, 2, 3), "ResNet stages followed by MixStyle"),
        ("cnn_widths", (64, 128, 128, 128), "the MNIST CNN's conv widths (DomainBed's)"),
    ),
    "optimizer (see sagm_jax.optimizers.paper_optimizer)": (
        ("algorithm", "sagm", "erm, sam, gsam, sagm, erm_sam (SAGM with alpha 0)"),
        ("lr", 3e-5, "Adam's learning rate (constant)"),
        ("weight_decay", 1e-4, "coupled L2 weight decay (added to the gradient, as torch's Adam)"),
        ("rho", 0.05, "radius of the perturbation (SAM, GSAM, SAGM)"),
        ("alpha", 1e-3, "SAGM's alpha; GSAM uses it as its alpha too"),
        ("combine", "mean", 'SAGM: "mean" (the released code) or "sum" (the paper\'s text)'),
        ("adaptive", False, "ASAM-style scaling of the perturbation by |w|"),
        (
            "perturbation",
            "global",
            '"global" (the one-device result) or "per_device" (m-sharpness, another algorithm)',
        ),
        ("shared_dropout", False, "reuse the clean pass's dropout mask in the perturbed pass"),
        ("compute_dtype", "float32", '"float32", or "bfloat16" on accelerators'),
        ("num_devices", 0, "devices of the batch mesh; 0 = every device of every host"),
    ),
    "schedule": (
        ("steps", 5001, "training steps (DomainBed's 5001; DomainNet 15001)"),
        ("eval_every", 100, "evaluate after step 0, every eval_every steps, and the last"),
        ("log_every", 10, "steps between training-loss logs"),
        ("checkpoint", True, "orbax checkpoints (resume, best model)"),
    ),
}


def base_config() -> ml_collections.ConfigDict:
    """Every field of :data:`FIELDS` at its default."""
    c = ml_collections.ConfigDict()
    for fields in FIELDS.values():
        for key, default, _ in fields:
            c[key] = default
    return c


def field_meanings() -> dict[str, str]:
    """``{key: meaning}`` of every config field."""
    return {key: meaning for fields in FIELDS.values() for key, _, meaning in fields}


# The paper's SAGM hyperparameters per dataset (ResNet-50, dropout 0.5, rho 0.05).
PAPER_HPARAMS = {
    "PACS": dict(lr=3e-5, weight_decay=1e-4, alpha=1e-3, steps=5001),
    "VLCS": dict(lr=1e-5, weight_decay=1e-4, alpha=1e-3, steps=5001),
    "OfficeHome": dict(lr=1e-5, weight_decay=1e-4, alpha=5e-4, steps=5001),
    "TerraIncognita": dict(lr=1e-5, weight_decay=1e-4, alpha=1e-3, steps=5001),
    "DomainNet": dict(lr=3e-5, weight_decay=1e-6, alpha=5e-4, steps=15001),
}


# torchvision's IMAGENET1K_V1 weights, the ones DomainBed starts from.
WEIGHTS_FILES = {"resnet50": "resnet50-0676ba61.pth", "resnet18": "resnet18-f37072fd.pth"}


def weights_url(arch: str) -> str:
    """Where torchvision's ImageNet weights for ``arch`` are downloaded from."""
    return "https://download.pytorch.org/models/" + WEIGHTS_FILES.get(arch, arch + "-*.pth")


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
    "input": ("device", "tf"),
    "image_store": ("auto", "cache", "stream"),
}


def config_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Every value a run cannot use, each naming its key and what was expected."""
    problems = []
    for key, choices in _CHOICES.items():
        if config[key] not in choices:
            problems.append(f"config.{key}={config[key]!r}: expected one of {', '.join(choices)}.")
    if not all(isinstance(e, int) and e >= 0 for e in config.test_envs) or not config.test_envs:
        problems.append(
            f"config.test_envs={config.test_envs!r}: expected environment indices, "
            "e.g. --config.test_envs=0 or --config.test_envs=0,1."
        )
    if int(config.num_devices) < 0:
        problems.append(f"config.num_devices={config.num_devices!r}: expected 0 (all) or more.")
    for key in ("steps", "eval_every", "log_every", "batch_per_env", "eval_batch_size"):
        if int(config[key]) < 1:
            problems.append(f"config.{key}={config[key]!r}: expected a positive integer.")
    if not 0.0 <= config.dropout < 1.0:
        problems.append(f"config.dropout={config.dropout!r}: expected a value in [0, 1).")
    if not 0.0 < config.holdout_fraction < 1.0:
        problems.append(
            f"config.holdout_fraction={config.holdout_fraction!r}: expected a value in (0, 1)."
        )
    if config.mixstyle and config.arch == "mnist_cnn":
        problems.append(
            "config.mixstyle=True: MixStyle sits between ResNet stages; "
            "config.arch='mnist_cnn' has none."
        )
    if config.arch != "mnist_cnn" and not config.pretrained_weights:
        problems.append(
            f"config.pretrained_weights is empty for config.arch={config.arch!r}. The paper "
            "starts from torchvision's IMAGENET1K_V1 weights: download them "
            f"({weights_url(config.arch)}), "
            "optionally convert once with `python -m sagm_jax.models.convert in.pth "
            "out.safetensors`, and pass --config.pretrained_weights=PATH; "
            "--config.pretrained_weights=none trains from scratch (not the paper's setting)."
        )
    return problems


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError listing every key whose value a run cannot use."""
    problems = config_problems(config)
    if problems:
        raise ValueError("\n".join(problems))


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
