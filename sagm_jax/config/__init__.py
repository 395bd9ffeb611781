"""The one config system: every field (:func:`fields`: key, default, meaning, check), the
base ml-collections config built from it, the paper's hyperparameters, and the checks.

Every file in ``configs/`` starts from :func:`base_config` and overrides the
fields its dataset needs; ``--config.key=value`` overrides on the command line.
:func:`section` gives the values of one section of :func:`fields` to the code that
owns it (``sagm_jax.training.train.optimizer_from_config`` takes ``"optimizer"``).
:func:`config_problems` runs every field's check (the checks of single values are
:mod:`sagm_jax.config.checks`) and lists every value the run cannot
honour, one line each, naming the key and what was expected (:func:`validate` raises
them); :func:`weights_problem` is the one check of the weights (with the file's format
before a run); :func:`config_warnings` lists settings that are likely slips but may be
meant. The names a field accepts come from their one registry each: datasets from
``sagm_jax.data.registry``, architectures from ``sagm_jax.models.ARCHS``, objectives, update
rules and their hyperparameters from ``sagm_jax.methods``; the weights files from
``sagm_jax.models``.
"""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple

import ml_collections

from sagm_jax.data.registry import DATASETS
from sagm_jax.formatting import flag_value
from sagm_jax.models import ARCHS
from sagm_jax.models.backbones import BACKBONES
from sagm_jax.models.mixstyle import MIXES as MIXSTYLE_MIXES
from sagm_jax.models.resnet import MIXSTYLE_STAGES
from sagm_jax.models.torchvision_weights import ACCEPTED_FORMATS, weights_file_problem
from sagm_jax.methods.registry import OBJECTIVES, UPDATE_RULES, owners
from sagm_jax.methods.registry import hyperparameters as method_hyperparameters
from sagm_jax.methods.update_rules import RHO
from sagm_jax.config import checks
from sagm_jax.config.checks import Check, test_envs_problem  # noqa: F401  (the CLI's)


class Field(NamedTuple):
    """One config field: what ``base_config`` sets, ``--help`` prints and
    :func:`config_problems` checks."""

    key: str
    default: object
    meaning: str
    check: Check


# --- the fields ---------------------------------------------------------------------

# The one definition of every config field, by section (fields() adds the "method"
# section, read from the method registries): base_config() builds the ConfigDict from
# it, `python -m sagm_jax.main --help` prints it under SECTION_TITLES, config_problems()
# runs each check, and section() hands one section's values to the code that owns it;
# DomainBed's and the paper's defaults where they exist.
FIELDS: dict[str, tuple[Field, ...]] = {
    "data": (
        Field(
            "dataset",
            "RotatedDigits",
            ", ".join(n for n in DATASETS if n != "ImageFolder")
            + ", or ImageFolder (your own DATA_DIR/<domain>/<class>/<image>)",
            checks.OneOf(tuple(DATASETS)),
        ),
        Field(
            "data_dir",
            "",
            "folder holding the dataset folders (PACS/, VLCS/, ...); see the README",
            checks.TEXT,
        ),
        Field(
            "test_envs",
            (0,),
            "held-out environments of one run (distinct indices)",
            checks.test_envs,
        ),
        Field(
            "all_test_envs",
            False,
            "one run per environment, then the table (SAGM's train_all)",
            checks.BOOL,
        ),
        Field("trial_seed", 0, "picks the split (DomainBed's trial_seed)", checks.integer(0)),
        Field("seed", 0, "picks initialization, batches, dropout, augmentation", checks.integer(0)),
        Field(
            "hparams_seed",
            -1,
            "DomainBed's hparams_seed: the index of a --hparams random setting "
            "(-1 = a hash of the hyperparameters)",
            checks.integer(-1),
        ),
        Field(
            "holdout_fraction",
            0.2,
            "the 'out' (validation) share of each environment",
            checks.number("(0, 1)"),
        ),
        Field(
            "split",
            "domainbed",
            "'domainbed' (80/20), 'in_domain' (60/20/20, the paper's Table 2) or 'full_data' "
            "(ERM++'s stage 2: 'in' is the whole environment, 'out' a part of it)",
            checks.OneOf(("domainbed", "in_domain", "full_data")),
        ),
        Field(
            "batch_per_env",
            32,
            "training examples per training environment and step",
            checks.integer(1),
        ),
        Field(
            "eval_splits",
            "fast",
            "\"fast\": what model selection reads (training envs' out, test envs' every "
            'part, in-domain test parts); "all": every part of every env (DomainBed)',
            checks.OneOf(("fast", "all")),
        ),
        Field(
            "eval_batch_size",
            0,
            "examples per evaluation batch; 0 = 128 per device on a CPU, 512 per GPU/TPU",
            checks.integer(0),
        ),
        Field(
            "eval_cache_gb",
            40.0,
            "evaluation inputs are kept on the accelerator up to this size (and half its "
            "free memory), else in host memory (up to half the free RAM), else decoded again",
            checks.number(">= 0"),
        ),
        Field(
            "augment_validation",
            False,
            "augment the 'out' splits too (DomainBed's old default)",
            checks.BOOL,
        ),
        Field(
            "skip_bad_files",
            False,
            "report and skip undecodable images instead of failing",
            checks.BOOL,
        ),
        Field("image_size", 224, "side of the model input for image folders", checks.image_size),
        Field(
            "input",
            "device",
            '"device": decode once, augment on the accelerator; "tf": tf.data on the host',
            checks.OneOf(("device", "tf")),
        ),
        Field(
            "image_store",
            "auto",
            '"cache" (decoded store on disk), "compressed" (JPEG store on disk, decoded per '
            'use), "stream" (decode the files per use), "auto" (decoded, else compressed, '
            "within store_budget_gb; else stream)",
            checks.OneOf(("auto", "cache", "compressed", "stream")),
        ),
        Field(
            "store_short_side",
            320,
            "stored images' shorter side is capped at this (every crop >= 224)",
            checks.store_short_side,
        ),
        Field(
            "store_budget_gb",
            64.0,
            '"auto": the most a store may take on disk (decoded, else compressed, else stream)',
            checks.number(">= 0"),
        ),
        Field(
            "cache_dir",
            "",
            'decoded stores and checks; "" = $SAGM_JAX_CACHE or ~/.cache/sagm_jax',
            checks.TEXT,
        ),
    ),
    "model": (
        # The table itself (not a copy of its names): a backbone registered later counts.
        Field("arch", "resnet50", ", ".join(ARCHS), checks.OneOf(BACKBONES)),
        Field(
            "pretrained_weights",
            "",
            "torchvision ImageNet weights (.pth/.safetensors/.npz); 'none' = from scratch",
            checks.kind(str, "a path, or 'none'"),
        ),
        Field("dropout", 0.5, "dropout on the pooled feature", checks.number("[0, 1)")),
        Field(
            "freeze_batchnorm",
            True,
            "BatchNorm uses its running statistics and never updates them",
            checks.BOOL,
        ),
        Field(
            "attention_only",
            False,
            "train only the ViT's attention layers and the classifier (DomainBed's vit_attn_tune)",
            checks.BOOL,
        ),
        Field(
            "mixstyle",
            False,
            "MixStyle after the ResNet stages mixstyle_after (SAGM + MixStyle)",
            checks.BOOL,
        ),
        Field(
            "mixstyle_after", MIXSTYLE_STAGES, "ResNet stages followed by MixStyle", checks.stages
        ),
        # The MixStyle paper and SWAD's repository use p 0.5; the SAGM repository's
        # random-MixStyle ResNet-50 builder sets p 1, its Mixstyle2 ones 0.5 (docs/methods.md).
        Field(
            "mixstyle_p",
            0.5,
            "probability that a MixStyle layer restyles a batch",
            checks.number("[0, 1]"),
        ),
        Field(
            "mixstyle_alpha",
            0.1,
            "MixStyle's Beta(alpha, alpha) mixing weights",
            checks.number("> 0"),
        ),
        Field(
            "mixstyle_mix",
            "random",
            '"random" (MixStyle: a permutation of the batch) or "crossdomain" (the SAGM '
            "repository's Mixstyle2: halves of consecutive domains)",
            checks.OneOf(MIXSTYLE_MIXES),
        ),
        Field(
            "cnn_widths",
            (64, 128, 128, 128),
            "the MNIST CNN's conv widths (DomainBed's)",
            checks.cnn_widths,
        ),
    ),
    # Where the network's weights start (sagm_jax.averaging.shared_init): another run's.
    "init": (
        Field(
            "init_from",
            "",
            "a finished run directory on the same data whose weights start this run "
            "(DiWA's shared initialisation)",
            checks.TEXT,
        ),
        Field(
            "init_weights",
            "last",
            "which of init_from's weights: last, best, swad or moving_average",
            checks.OneOf(("last", "best", "swad", "moving_average")),
        ),
        Field(
            "init_featurizer_from",
            "",
            "a finished run directory on ANOTHER dataset whose featurizer (its last weights, "
            "all but the classifier) starts this run (Model Ratatouille)",
            checks.TEXT,
        ),
    ),
    "optimizer": (
        Field("lr", 3e-5, "Adam's learning rate (constant)", checks.number("> 0")),
        Field(
            "weight_decay",
            1e-4,
            "coupled L2 weight decay (added to the gradient, as torch's Adam)",
            checks.number(">= 0"),
        ),
        Field("adaptive", False, "ASAM-style scaling of the perturbation by |w|", checks.BOOL),
        Field(
            "perturbation",
            "global",
            '"global" (the one-device result) or "per_device" (m-sharpness, another algorithm)',
            checks.OneOf(("global", "per_device")),
        ),
        Field(
            "linear_steps",
            0,
            "the first linear_steps updates train only the classifier, by an Adam of their "
            "own at linear_lr (DiWA's linear probe, ERM++'s linear phase); the rule's own "
            "Adam starts fresh after them",
            checks.linear_steps,
        ),
        Field(
            "linear_lr",
            0.0,
            "the linear probe's learning rate (0 = config.lr)",
            checks.number(">= 0"),
        ),
        Field(
            "lr_plateau",
            False,
            "ERM++'s stage 1: after the linear phase each evaluation steps torch's "
            "ReduceLROnPlateau (factor 0.1, patience 1) on the validation loss; the run stops "
            "at its third change (sagm_jax.averaging.erm_plusplus)",
            checks.BOOL,
        ),
        Field(
            "lr_schedule",
            (),
            "ERM++'s stage 2: the learning rate (a factor of lr) set after each evaluation "
            "from the end of the linear phase on, replayed from stage 1",
            checks.lr_schedule,
        ),
    ),
    "step": (
        Field(
            "shared_dropout",
            False,
            "reuse the clean pass's dropout mask in the perturbed pass",
            checks.BOOL,
        ),
        Field(
            "compute_dtype",
            "float32",
            '"float32", or "bfloat16" on accelerators',
            checks.OneOf(("float32", "bfloat16")),
        ),
        Field(
            "num_devices",
            0,
            "devices of the batch mesh; 0 = every device of every host",
            checks.num_devices,
        ),
    ),
    "swad": (
        Field(
            "swad",
            False,
            "SWAD: average the weights densely over the validation loss's valley",
            checks.BOOL,
        ),
        Field(
            "swad_eval_every",
            100,
            "with swad=True, the evaluation interval (SWAD's per-dataset frequency)",
            checks.integer(1),
        ),
        Field(
            "swad_n_converge", 3, "evaluations the loss must stop falling for", checks.integer(1)
        ),
        Field(
            "swad_n_tolerance",
            6,
            "evaluations above the tolerance that end the valley",
            checks.swad_tolerance,
        ),
        Field(
            "swad_tolerance_ratio",
            0.3,
            "the valley's tolerance: (1 + ratio) x the converged loss",
            checks.number(">= 0"),
        ),
        Field(
            "swad_fix_quirks",
            False,
            "fix the reference's segment quirks (skipped, repeated, pre-convergence segments)",
            checks.BOOL,
        ),
        Field(
            "swad_batchnorm_batches",
            500,
            "trainable BatchNorm: training minibatches that re-estimate the SWAD model's "
            "statistics",
            checks.integer(1),
        ),
        Field(
            "swad_stop_at_valley_end",
            True,
            "stop training when the valley ends, as the reference does",
            checks.BOOL,
        ),
    ),
    # A run's moving average of its weights (sagm_jax.averaging.moving_average).
    "averaging": (
        Field(
            "moving_average",
            False,
            "predict with (evaluate, select the best step of, save) the simple moving "
            "average of the weights (EoA's and DiWA's MA, ERM++'s)",
            checks.moving_average,
        ),
        Field(
            "moving_average_start",
            100,
            "the update from which the average accumulates (the references' "
            "sma_start_iter: EoA 100, ERM++ 600); before it, it is the weights",
            checks.integer(1),
        ),
        Field(
            "moving_average_batchnorm_forward",
            False,
            "ERM++: with trainable BatchNorm, a training-mode forward of the average on "
            "each step's batch also updates the average's statistics",
            checks.moving_average_batchnorm_forward,
        ),
    ),
    "schedule": (
        Field(
            "steps",
            5001,
            "training steps (DomainBed's 5001; DomainNet 15001)",
            # The step counter is a 32-bit integer on the device.
            checks.integer(1, at_most=2**31 - 1, why=" (the step counter is a 32-bit integer)"),
        ),
        Field(
            "eval_every",
            100,
            "evaluate after step 0, every eval_every steps, and the last",
            checks.integer(1),
        ),
        Field("log_every", 10, "steps between training-loss logs", checks.integer(1)),
        Field("checkpoint", True, "orbax checkpoints (resume, best model)", checks.BOOL),
    ),
}
# What `--help` prints above each section.
SECTION_TITLES = {
    "data": "data (see sagm_jax.data)",
    "model": "model (see sagm_jax.models)",
    "init": "the network's start from other runs (see sagm_jax.averaging.shared_init)",
    "method": "objective, update rule and their hyperparameters (see sagm_jax.methods)",
    "optimizer": "Adam and the heads' settings (see sagm_jax.methods.update_rules)",
    "step": "train step and devices (see sagm_jax.training.train_step)",
    "swad": "SWAD weight averaging (see sagm_jax.averaging.valley, sagm_jax.averaging.swad_averages)",
    "averaging": "the weights' moving average (see sagm_jax.averaging.moving_average)",
    "schedule": "schedule",
}


def method_fields() -> tuple[Field, ...]:
    """The "method" section, read from ``sagm_jax.methods``' registries as they are now (a
    method registered at run time brings its hyperparameters): the objective, the update
    rule, and every hyperparameter of a registered method with its default, meaning and
    bounds (rho's own check: 0 is refused for a rule that perturbs)."""
    fields = [
        Field(
            "objective",
            "erm",
            "the loss a step minimises: " + ", ".join(OBJECTIVES),
            checks.OneOf(tuple(OBJECTIVES)),
        ),
        Field(
            "algorithm",
            "sagm",
            "the update rule: " + ", ".join(UPDATE_RULES) + " (erm_sam: SAGM with alpha 0)",
            checks.OneOf(tuple(UPDATE_RULES)),
        ),
    ]
    taken = {field.key for section_fields in FIELDS.values() for field in section_fields}
    for hp in method_hyperparameters():
        if hp.key in taken:
            raise ValueError(
                f"method hyperparameter {hp.key!r} ({', '.join(owners(hp.key))}) is a config "
                "field of its own already; register it under another key."
            )
        check = checks.rho if hp.key == "rho" else checks.bounds(hp.bounds, hp.note)
        fields.append(Field(hp.key, hp.default, hp.meaning, check))
    return tuple(fields)


def fields() -> dict[str, tuple[Field, ...]]:
    """Every section's fields: :data:`FIELDS` with the "method" section after "model"."""
    result = {}
    for name, section_fields in FIELDS.items():
        result[name] = section_fields
        if name == "model":
            result["method"] = method_fields()
    return result


def all_fields() -> Iterator[Field]:
    """Every field of :func:`fields`, section by section."""
    for section_fields in fields().values():
        yield from section_fields


def base_config() -> ml_collections.ConfigDict:
    """Every field of :func:`fields` at its default."""
    c = ml_collections.ConfigDict()
    for field in all_fields():
        c[field.key] = field.default
    return c


def section(config: ml_collections.ConfigDict, name: str) -> dict:
    """``{key: value}`` of the fields of one section of :func:`fields` (``"data"``,
    ``"model"``, ``"method"``, ``"optimizer"``, ...), so that the code owning a section
    takes its values without a hand-kept list of keys."""
    sections = fields()
    if name not in sections:
        raise ValueError(f"section {name!r}: expected one of {', '.join(sections)}.")
    return {field.key: config[field.key] for field in sections[name]}


def resnet50_config(dataset: str) -> ml_collections.ConfigDict:
    """:func:`base_config` with the paper's model for ``dataset``: ResNet-50 from
    torchvision's ImageNet weights, dropout 0.5, rho 0.05, SAGM. The per-dataset
    numbers (lr, weight decay, alpha, steps) are set in ``configs/<dataset>.py``."""
    config = base_config()
    config.dataset = dataset
    config.arch, config.dropout, config.rho = "resnet50", 0.5, RHO
    return config


def mnist_config(dataset: str) -> ml_collections.ConfigDict:
    """DomainBed's MNIST settings: its CNN, lr 1e-3, batch 64 per environment, no
    weight decay, no dropout; DANN's and CDANN's learning rates 1e-3 (``SMALL_IMAGES``
    in DomainBed's ``hparams_registry.py``)."""
    config = base_config()
    config.dataset = dataset
    config.arch, config.lr, config.weight_decay, config.dropout = "mnist_cnn", 1e-3, 0.0, 0.0
    config.batch_per_env = 64
    config.lr_g = config.lr_d = 1e-3
    return config


# --- the checks of a whole config ----------------------------------------------------


from sagm_jax.config.combinations import (  # noqa: E402,F401  (the sweep's preflight's too)
    attention_only_problems,
    crossdomain_mixstyle_problems,
    mixstyle_network_problems,
    device_batch_problems,
    method_problems,
    mldg_problem,
    training_environments,
    unused_setting_problems,
)


def config_problems(
    config: ml_collections.ConfigDict,
    device_count: int | None = None,
    check_files: bool = False,
) -> list[str]:
    """Every value a run cannot use, one line each, naming its key (``config.KEY=value``)
    and what was expected; all of them at once. ``device_count`` (JAX's, when known)
    bounds ``num_devices``; ``check_files`` also looks for the weights file on this
    machine (the command line does, before a run)."""
    problems = [problem for _, problem in field_problems(config, device_count)]
    problems += mixstyle_network_problems(config) + attention_only_problems(config)
    problems += method_problems(config) + crossdomain_mixstyle_problems(config)
    weights = weights_problem(config, check_files)
    return problems + ([weights] if weights else [])


def field_problems(
    config: ml_collections.ConfigDict, device_count: int | None = None
) -> Iterator[tuple[str, str]]:
    """``(key, problem)`` for each field of :func:`fields` whose value fails its check."""
    for field in all_fields():
        if field.key not in config:
            yield field.key, f"config.{field.key} is missing: expected a value (see --help)."
        elif expected := field.check(config[field.key], config, device_count):
            value = flag_value(config[field.key])
            yield field.key, f"config.{field.key}={value}: expected {expected}."


def weights_problem(config: ml_collections.ConfigDict, check_file: bool = False) -> str | None:
    """What keeps the network from starting from ``config.pretrained_weights``: weights
    given to a network that takes none (the MNIST CNN); for a ResNet, the paper's start
    from torchvision's ImageNet weights left empty or, with ``check_file``, a path that
    names no file or a file that is not a weights file (its extension and first bytes;
    found before the data is read, not after). None when the weights are there, the
    network takes none and none are given, or ``"none"`` asks for a start from scratch."""
    arch, weights = config.get("arch"), config.get("pretrained_weights")
    if not isinstance(weights, str) or weights.lower() == "none":
        return None
    backbone = BACKBONES.get(arch)
    if backbone is None:
        return None  # the arch's own check names it
    if backbone.weights_file is None:
        takes = ", ".join(name for name, b in BACKBONES.items() if b.weights_file)
        return (
            f"--config.pretrained_weights={weights}: config.arch={arch} takes no weights "
            f"(pretrained weights fit {takes}); leave it empty." if weights else None
        )
    get = (
        f"config.arch={arch} starts from {backbone.source}: download {backbone.weights_url} "
        "(reading a .pth needs torch, a CPU build; or convert it once with "
        f"`python -m sagm_jax.models.convert {backbone.weights_file} {arch}.safetensors` "
        "and pass that file; README 'ImageNet weights'). "
        "--config.pretrained_weights=none trains from scratch (not the published setting)."
    )
    if not weights:
        return f"--config.pretrained_weights=FILE is missing. {get}"
    if check_file and not os.path.isfile(weights):
        return f"--config.pretrained_weights={weights}: no such file. {get}"
    if check_file and (why := weights_file_problem(weights)):
        return (
            f"--config.pretrained_weights={weights}: not a weights file ({why}). Accepted: "
            f"{ACCEPTED_FORMATS}. {get}"
        )
    return None


def config_warnings(config: ml_collections.ConfigDict) -> list[str]:
    """Settings a researcher may mean but that are most likely a slip, one line each,
    naming the keys and the flag that undoes it; the command line prints them before a
    run starts."""
    warnings = []
    weights = config.get("pretrained_weights")
    scratch = isinstance(weights, str) and weights.lower() == "none"
    batchnorm = getattr(BACKBONES.get(config.get("arch")), "batchnorm", False)
    if batchnorm and scratch and config.get("freeze_batchnorm") is True:
        warnings.append(
            f"config.pretrained_weights={weights} with config.freeze_batchnorm=True: "
            f"the {config.arch}'s BatchNorm keeps its initial statistics (mean 0, variance 1) "
            "for the whole run and never learns the data's; "
            "--config.freeze_batchnorm=False trains it (frozen BatchNorm is meant for "
            "pretrained weights)."
        )
    # A warning, not a refusal: a config file's eval_every (rotated_digits.py's 50) is
    # not told apart from a typed one, and SWAD runs of those files are meant.
    eval_every, swad_every = config.get("eval_every"), config.get("swad_eval_every")
    if config.get("swad") is True and eval_every != swad_every:
        warnings.append(
            f"config.eval_every={flag_value(eval_every)} is not used with config.swad=True: "
            f"SWAD evaluates every config.swad_eval_every={flag_value(swad_every)} steps; "
            f"--config.swad_eval_every={flag_value(eval_every)} evaluates every "
            f"{flag_value(eval_every)}."
        )
    return warnings


def validate(config: ml_collections.ConfigDict, device_count: int | None = None) -> None:
    """Raises ValueError listing every key whose value a run cannot use (one per line)."""
    problems = config_problems(config, device_count)
    if problems:
        raise ValueError("\n".join(problems))


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every key of ``config``, those of nested ConfigDicts as ``outer.inner``: the keys
    ``--config.KEY=`` can name."""
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            keys += flat_keys(value, prefix + key + ".")
    return keys
