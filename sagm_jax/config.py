"""The one config system: every field (:data:`FIELDS`: key, default, meaning), the base
ml-collections config built from it, the paper's hyperparameters, and the checks.

Every file in ``configs/`` starts from :func:`base_config` and overrides the
fields its dataset needs; ``--config.key=value`` overrides on the command line.
:func:`section` gives the values of one section of :data:`FIELDS` to the code that
owns it (``sagm_jax.optimizers.optimizer_from_config`` takes ``"optimizer"``).
:func:`config_problems` checks every field's type and range and lists every value the
run cannot honour, one line each, naming the key and what was expected
(:func:`validate` raises them), and :func:`check_overrides` rejects an override of a
key that does not exist, listing the valid keys (ml-collections alone answers with a
bare AttributeError). The names it accepts come from their one registry each:
datasets from ``sagm_jax.data.registry``, architectures from ``sagm_jax.models.ARCHS``,
algorithms from ``sagm_jax.optimizers.ALGORITHMS``.
"""

from __future__ import annotations

import importlib.util
import math
import re
from typing import Sequence

import ml_collections

from sagm_jax.data.registry import DATASETS
from sagm_jax.models import ARCHS
from sagm_jax.models.mnist_cnn import CONV_LAYERS, GROUPNORM_GROUPS
from sagm_jax.models.resnet import MIXSTYLE_STAGES
from sagm_jax.optimizers import ALGORITHMS, GSAM_ALPHA, SAGM_ALPHA


# The one definition of every config field: (key, default, meaning), by section.
# base_config() builds the ConfigDict from it, `python -m sagm_jax.main --help` prints
# it under SECTION_TITLES, and section() hands one section's values to the code that
# owns it; DomainBed's and the paper's defaults where they exist.
FIELDS: dict[str, tuple[tuple[str, object, str], ...]] = {
    "data": (
        (
            "dataset",
            "RotatedDigits",
            ", ".join(n for n in DATASETS if n != "ImageFolder")
            + ", or ImageFolder (your own DATA_DIR/<domain>/<class>/<image>)",
        ),
        ("data_dir", "", "folder holding the dataset folders (PACS/, VLCS/, ...); see the README"),
        ("test_envs", (0,), "held-out environments of one run (distinct indices)"),
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
    "model": (
        ("arch", "resnet50", ", ".join(ARCHS)),
        (
            "pretrained_weights",
            "",
            "torchvision ImageNet weights (.pth/.safetensors/.npz); 'none' = from scratch",
        ),
        ("dropout", 0.5, "dropout on the pooled feature"),
        ("freeze_batchnorm", True, "BatchNorm uses its running statistics and never updates them"),
        ("mixstyle", False, "MixStyle after the ResNet stages mixstyle_after (SAGM + MixStyle)"),
        ("mixstyle_after", MIXSTYLE_STAGES, "ResNet stages followed by MixStyle"),
        ("cnn_widths", (64, 128, 128, 128), "the MNIST CNN's conv widths (DomainBed's)"),
    ),
    "optimizer": (
        ("algorithm", "sagm", ", ".join(ALGORITHMS) + " (erm_sam: SAGM with alpha 0)"),
        ("lr", 3e-5, "Adam's learning rate (constant)"),
        ("weight_decay", 1e-4, "coupled L2 weight decay (added to the gradient, as torch's Adam)"),
        ("rho", 0.05, "radius of the perturbation (SAM, GSAM, SAGM)"),
        ("alpha", SAGM_ALPHA, "SAGM's alpha, in its ascent step e = (rho/||g|| - alpha) g"),
        (
            "gsam_alpha",
            GSAM_ALPHA,
            "GSAM's alpha (its paper's setting for ResNets), in d = g_p - alpha g_perp",
        ),
        ("combine", "mean", 'SAGM: "mean" (the released code) or "sum" (the paper\'s text)'),
        ("adaptive", False, "ASAM-style scaling of the perturbation by |w|"),
        (
            "perturbation",
            "global",
            '"global" (the one-device result) or "per_device" (m-sharpness, another algorithm)',
        ),
    ),
    "step": (
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
# What `--help` prints above each section.
SECTION_TITLES = {
    "data": "data (see sagm_jax.data)",
    "model": "model (see sagm_jax.models)",
    "optimizer": "optimizer (see sagm_jax.optimizers.optimizer_from_config)",
    "step": "train step and devices (see sagm_jax.train_step)",
    "schedule": "schedule",
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


def section(config: ml_collections.ConfigDict, name: str) -> dict:
    """``{key: value}`` of the fields of one section of :data:`FIELDS` (``"data"``,
    ``"model"``, ``"optimizer"``, ``"step"``, ``"schedule"``), so that the code owning a
    section takes its values without a hand-kept list of keys."""
    if name not in FIELDS:
        raise ValueError(f"section {name!r}: expected one of {', '.join(FIELDS)}.")
    return {key: config[key] for key, _, _ in FIELDS[name]}


# torchvision's IMAGENET1K_V1 weights, the ones DomainBed starts from.
WEIGHTS_FILES = {"resnet50": "resnet50-0676ba61.pth", "resnet18": "resnet18-f37072fd.pth"}


def weights_url(arch: str) -> str:
    """Where torchvision's ImageNet weights for ``arch`` are downloaded from."""
    return "https://download.pytorch.org/models/" + WEIGHTS_FILES.get(arch, arch + "-*.pth")


def resnet50_config(dataset: str) -> ml_collections.ConfigDict:
    """:func:`base_config` with the paper's model for ``dataset``: ResNet-50 from
    torchvision's ImageNet weights, dropout 0.5, rho 0.05, SAGM. The per-dataset
    numbers (lr, weight decay, alpha, steps) are set in ``configs/<dataset>.py``."""
    config = base_config()
    config.dataset = dataset
    config.arch, config.dropout, config.rho = "resnet50", 0.5, 0.05
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
    "dataset": tuple(DATASETS),
    "algorithm": ALGORITHMS,
    "arch": ARCHS,
    "combine": ("mean", "sum"),
    "perturbation": ("global", "per_device"),
    "split": ("domainbed", "in_domain"),
    "compute_dtype": ("float32", "bfloat16"),
    "input": ("device", "tf"),
    "image_store": ("auto", "cache", "stream"),
}
# The algorithms that perturb the weights, for which rho = 0 is not the algorithm.
_PERTURBING = ("sam", "gsam", "sagm", "erm_sam")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )


def _int_at_least(low: int, what: str = ""):
    def check(value, config):
        if not (_is_int(value) and value >= low):
            return ("a positive integer" if low == 1 else f"an integer >= {low}") + what

    return check


def _number_in(low: float, high: float, low_open: bool, high_open: bool, why: str = ""):
    if high == math.inf:
        interval = f"{'>' if low_open else '>='} {low:g}"
    else:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(value, config):
        ok = _is_number(value) and (value > low if low_open else value >= low)
        ok = ok and (value < high if high_open else value <= high)
        if not ok:
            return f"a number {interval}{why}"

    return check


def _kind(kind, text: str):
    def check(value, config):
        if not isinstance(value, kind):
            return text

    return check


def _choice(key: str):
    def check(value, config):
        if not isinstance(value, str) or value not in _CHOICES[key]:
            return f"one of {', '.join(_CHOICES[key])}"

    return check


def _test_envs(value, config):
    expected = (
        "environment indices (distinct, >= 0), e.g. --config.test_envs=0 or "
        "--config.test_envs=0,1"
    )
    if not isinstance(value, (tuple, list)) or not value:
        return expected
    if not all(_is_int(e) and e >= 0 for e in value) or len(set(value)) != len(value):
        return expected
    spec = DATASETS.get(config.get("dataset"))
    if spec is not None and spec.domains and max(value) >= len(spec.domains):
        envs = ", ".join(f"{i} {name}" for i, name in enumerate(spec.domains))
        return f"indices of {config.dataset}'s environments ({envs})"


def _stages(value, config):
    stages = ", ".join(str(s) for s in MIXSTYLE_STAGES)
    expected = f"distinct ResNet stages among {stages}"
    if not isinstance(value, (tuple, list)) or len(set(value)) != len(value):
        return expected
    if not all(_is_int(s) and s in MIXSTYLE_STAGES for s in value):
        return expected
    if config.get("mixstyle") is True and not value:
        return expected + " (config.mixstyle=True with no stage is no MixStyle)"


def _cnn_widths(value, config):
    expected = (
        f"{len(CONV_LAYERS)} positive multiples of {GROUPNORM_GROUPS} (GroupNorm's groups), "
        "e.g. 64,128,128,128"
    )
    if not isinstance(value, (tuple, list)) or len(value) != len(CONV_LAYERS):
        return expected
    if not all(_is_int(w) and w > 0 and w % GROUPNORM_GROUPS == 0 for w in value):
        return expected


def _store_short_side(value, config):
    if not _is_int(value) or value < 1:
        return "a positive integer"
    if _is_int(config.get("image_size")) and value < config.image_size:
        return (
            f"an integer >= config.image_size={config.image_size} (a smaller store would "
            "upsample every crop from a downscaled image)"
        )


def _rho(value, config):
    if not _is_number(value) or value < 0:
        return "a number >= 0 (the radius of the perturbation)"
    if value == 0 and config.get("algorithm") in _PERTURBING:
        return f"a number > 0: with rho 0, algorithm={config.algorithm!r} does not perturb"


_TEXT = "a string"
# Every field's check: value, config -> None, or what was expected. The ranges of
# the two alphas follow from what each algorithm does with its alpha.
_RULES = {
    "dataset": _choice("dataset"),
    "data_dir": _kind(str, _TEXT),
    "test_envs": _test_envs,
    "all_test_envs": _kind(bool, "True or False"),
    "trial_seed": _int_at_least(0),
    "seed": _int_at_least(0),
    "holdout_fraction": _number_in(0, 1, True, True),
    "split": _choice("split"),
    "batch_per_env": _int_at_least(1),
    "eval_batch_size": _int_at_least(1),
    "augment_validation": _kind(bool, "True or False"),
    "skip_bad_files": _kind(bool, "True or False"),
    "image_size": _int_at_least(1),
    "input": _choice("input"),
    "image_store": _choice("image_store"),
    "store_short_side": _store_short_side,
    "store_budget_gb": _number_in(0, math.inf, False, True),
    "cache_dir": _kind(str, _TEXT),
    "arch": _choice("arch"),
    "pretrained_weights": _kind(str, "a path, or 'none'"),
    "dropout": _number_in(0, 1, False, True),
    "freeze_batchnorm": _kind(bool, "True or False"),
    "mixstyle": _kind(bool, "True or False"),
    "mixstyle_after": _stages,
    "cnn_widths": _cnn_widths,
    "algorithm": _choice("algorithm"),
    "lr": _number_in(0, math.inf, True, True),
    "weight_decay": _number_in(0, math.inf, False, True),
    "rho": _rho,
    # e = (rho/||g|| - alpha) g: alpha is the step size of SAGM's descent term. Below 0
    # that term ascends too and e outgrows the rho-ball with ||g||; at 1 or more it is a
    # whole gradient step or more, larger than any learning rate here (the paper: 5e-4,
    # 1e-3; its code's search: up to 0.1).
    "alpha": _number_in(
        0,
        1,
        False,
        True,
        " (SAGM's descent step size in e = (rho/||g|| - alpha) g; the paper uses 5e-4 or "
        "1e-3; a negative alpha lengthens the ascent step beyond the rho-ball)",
    ),
    # d = g_p - alpha g_perp: below 0 GSAM descends the surrogate gap's ascent direction
    # (the opposite of GSAM); above 1 the orthogonal step outweighs the SAM step.
    "gsam_alpha": _number_in(
        0,
        1,
        False,
        False,
        " (GSAM's weight of the orthogonal ascent in d = g_p - alpha g_perp; 0 is SAM, "
        f"its paper's setting for ResNets is {GSAM_ALPHA:g})",
    ),
    "combine": _choice("combine"),
    "adaptive": _kind(bool, "True or False"),
    "perturbation": _choice("perturbation"),
    "shared_dropout": _kind(bool, "True or False"),
    "compute_dtype": _choice("compute_dtype"),
    "num_devices": _int_at_least(0, " (0 = every device)"),
    "steps": _int_at_least(1),
    "eval_every": _int_at_least(1),
    "log_every": _int_at_least(1),
    "checkpoint": _kind(bool, "True or False"),
}


def config_problems(
    config: ml_collections.ConfigDict, device_count: int | None = None
) -> list[str]:
    """Every value a run cannot use, one line each, naming its key (``config.KEY=value``)
    and what was expected; all of them at once. ``device_count`` (JAX's, when known)
    bounds ``num_devices``."""
    problems = []
    for key in (key for fields in FIELDS.values() for key, _, _ in fields):
        if key not in config:
            problems.append(f"config.{key} is missing: expected a value (see --help).")
            continue
        expected = _RULES[key](config[key], config)
        if not expected and key == "num_devices" and device_count is not None:
            if config[key] > device_count:
                expected = f"at most the {device_count} device(s) JAX sees (0 = all of them)"
        if expected:
            problems.append(f"config.{key}={_show(config[key])}: expected {expected}.")
    if config.get("mixstyle") is True and config.get("arch") == "mnist_cnn":
        problems.append(
            "config.mixstyle=True: MixStyle sits between ResNet stages; "
            "config.arch='mnist_cnn' has none."
        )
    return problems + _weights_problems(config)


def _show(value) -> str:
    return repr(tuple(value)) if isinstance(value, list) else repr(value)


def _weights_problems(config) -> list[str]:
    if config.get("arch") in ("resnet18", "resnet50") and config.get("pretrained_weights") == "":
        return [
            f"config.pretrained_weights is empty for config.arch={config.arch!r}. The paper "
            "starts from torchvision's IMAGENET1K_V1 weights: download them "
            f"({weights_url(config.arch)}), "
            "optionally convert once with `python -m sagm_jax.models.convert in.pth "
            "out.safetensors`, and pass --config.pretrained_weights=PATH; "
            "--config.pretrained_weights=none trains from scratch (not the paper's setting)."
        ]
    return []


def validate(config: ml_collections.ConfigDict, device_count: int | None = None) -> None:
    """Raises ValueError listing every key whose value a run cannot use (one per line)."""
    problems = config_problems(config, device_count)
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
