"""The checks of combinations of config keys: what a method, MixStyle's cross-domain mix
and MLDG's split need of the rest of the config, one line per problem, naming the keys
and what to set instead (``config_problems`` gathers them with the fields' own checks).
Two more that know what a config cannot: :func:`unused_setting_problems`, a method's
own setting given on the command line while the method is not in the run (the command
line passes the keys it was given), and :func:`device_batch_problems`, a batch that does
not divide among the devices (the command line passes the device count and, for an image
folder, the domains it listed)."""

from __future__ import annotations

from typing import Iterable

import ml_collections

from sagm_jax.config import checks
from sagm_jax.models.backbones import BACKBONES
from sagm_jax.data.registry import DATASETS
from sagm_jax.formatting import flag_value
from sagm_jax.methods.procedures import mldg_split_problem
from sagm_jax.methods.registry import (
    OBJECTIVES,
    UPDATE_RULES,
    combination_problem,
    owners,
    rule_names,
)


def method_problems(config: ml_collections.ConfigDict) -> list[str]:
    """The objective x update rule x DISAM combinations a run cannot train, one line each
    (``methods.combination_problem``), and the settings a method cannot honour:
    per-domain statistics need the global batch (``perturbation=per_device`` shards it),
    and the procedures copy and interpolate weights, not BatchNorm statistics."""
    objective, algorithm = config.get("objective"), config.get("algorithm")
    disam = config.get("disam_lambda")
    if objective not in OBJECTIVES or algorithm not in UPDATE_RULES or not checks.is_number(disam):
        return []  # named by the fields' own checks
    problems = [combination_problem(objective, algorithm, disam)]
    if config.get("perturbation") == "per_device" and (
        objective != "erm" or algorithm in rule_names("procedure") or disam
    ):
        problems.append(
            f"config.perturbation=per_device with objective={objective}, "
            f"algorithm={algorithm}, disam_lambda={disam:g}: per-device perturbation sees "
            "one shard of the batch, and the objectives, procedures and DISAM need each "
            "domain's whole minibatch; use --config.perturbation=global."
        )
    if algorithm in rule_names("procedure") and config.get("freeze_batchnorm") is False:
        problems.append(
            f"config.algorithm={algorithm} with config.freeze_batchnorm=False: the procedures "
            "update the weights from passes of their own and leave BatchNorm's statistics "
            "out (DomainBed's published protocol freezes them); use "
            "--config.freeze_batchnorm=True."
        )
    batch, entry = config.get("batch_per_env"), OBJECTIVES[objective]
    if checks.is_int(batch) and 1 <= batch < entry.min_batch_per_env:
        problems.append(
            f"config.batch_per_env={batch} with config.objective={objective}: "
            f"{entry.min_batch_reason}; use --config.batch_per_env="
            f"{entry.min_batch_per_env} or more."
        )
    train_envs = training_environments(config)
    if train_envs is not None and train_envs < entry.min_train_domains:
        problems.append(
            f"config.test_envs={config.get('test_envs')} with config.objective={objective}: "
            f"{train_envs} training environment(s); {entry.min_domains_reason}; hold out "
            f"fewer environments, so that {entry.min_train_domains} or more train."
        )
    return [p for p in problems + [mldg_problem(config)] if p]


def crossdomain_mixstyle_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Crossdomain MixStyle pairs halves of consecutive domains' minibatches by their
    rows (``sagm_jax.models.mixstyle``): it needs an even ``batch_per_env``, the whole
    batch in one forward (not ``perturbation=per_device``'s shards) and every domain in
    it (the procedures forward in passes of their own)."""
    if not (config.get("mixstyle") is True and config.get("mixstyle_mix") == "crossdomain"):
        return []
    batch, flag = config.get("batch_per_env"), "config.mixstyle_mix=crossdomain"
    problems = []
    if checks.is_int(batch) and batch % 2:
        problems.append(f"{flag} with config.batch_per_env={batch}: each domain's minibatch "
                        f"is cut in two halves; use --config.batch_per_env={batch + 1} (even).")
    if config.get("perturbation") == "per_device":
        problems.append(f"{flag} with config.perturbation=per_device: a shard holds part of "
                        "each domain; use --config.perturbation=global.")
    if config.get("algorithm") in rule_names("procedure"):
        problems.append(f"{flag} with config.algorithm={config.get('algorithm')}: the "
                        "procedures forward in passes of their own; use --config.algorithm=erm "
                        "or another update rule.")
    return problems


def mixstyle_network_problems(config: ml_collections.ConfigDict) -> list[str]:
    """MixStyle sits between ResNet stages, so ``mixstyle=True`` needs a ResNet; for the
    offline default's MNIST CNN the fix is a ResNet-18 from scratch (no ImageNet weights
    to download), its BatchNorm trained (the procedures keep theirs frozen), on inputs of
    at least ``checks.RESNET_STRIDE`` pixels (docs/methods.md, "MixStyle offline")."""
    if config.get("mixstyle") is not True or config.get("arch") not in BACKBONES:
        return []
    if config.get("arch") != "mnist_cnn":
        if BACKBONES[config.get("arch")].mixstyle:
            return []
        resnets = ", ".join(name for name, b in BACKBONES.items() if b.mixstyle)
        return [f"config.mixstyle=True: MixStyle sits between the stages of the ResNets "
                f"({resnets}); config.arch={config.get('arch')} has none."]
    fix = "--config.arch=resnet18 --config.pretrained_weights=none"
    if config.get("algorithm") not in rule_names("procedure"):
        fix += " --config.freeze_batchnorm=False"
    size = config.get("image_size")
    if checks.is_int(size) and size < checks.RESNET_STRIDE:
        fix += f" --config.image_size={checks.RESNET_STRIDE}"
    return [
        (
            "config.mixstyle=True: MixStyle sits between ResNet stages; config.arch=mnist_cnn "
            f"has none. To try it offline use {fix} (a ResNet-18 from scratch; "
            "docs/methods.md, 'MixStyle offline')."
        )
    ]


def attention_only_problems(config: ml_collections.ConfigDict) -> list[str]:
    """``attention_only`` (DomainBed HEAD's ``vit_attn_tune``) needs a ViT, whose attention
    layers it trains, and an update rule whose gradients the train step computes (a
    procedure keeps its own optimizers)."""
    if config.get("attention_only") is not True:
        return []
    arch, algorithm = config.get("arch"), config.get("algorithm")
    vits = [name for name, b in BACKBONES.items() if not b.feature_maps]
    if arch in BACKBONES and arch not in vits:
        return [f"config.attention_only=True trains a ViT's attention layers; config.arch={arch} "
                f"has none (expected one of {', '.join(vits)})."]
    if algorithm in rule_names("procedure"):
        return [f"config.attention_only=True: algorithm={algorithm} is a procedure with its own "
                "optimizers; expected erm, sam, gsam or sagm (or another update rule)."]
    return []


def training_environments(
    config: ml_collections.ConfigDict, num_domains: int | None = None
) -> int | None:
    """How many environments a run of ``config`` trains on, from the dataset registry
    (or ``num_domains``, an image folder's listed domains) and ``test_envs``
    (``all_test_envs``: each run holds one out); None where the domains are known only
    once the data is listed (an image folder) or the values are invalid (named by the
    fields' own checks)."""
    spec = DATASETS.get(config.get("dataset"))
    if spec is None:
        return None
    domains = len(spec.domains) if spec.domains else num_domains
    if not domains:
        return None
    if config.get("all_test_envs") is True:
        return domains - 1 or None
    test_envs = config.get("test_envs")
    if checks.test_envs(test_envs, config, None) or max(test_envs, default=-1) >= domains:
        return None
    return domains - len(test_envs) or None


def mldg_problem(config: ml_collections.ConfigDict) -> str | None:
    """MLDG's meta-test split against the run's training environments
    (``procedures.mldg_split_problem``), before set-up where they are known; an image
    folder's is checked at set-up."""
    n_meta_test, num_domains = config.get("mldg_n_meta_test"), training_environments(config)
    if config.get("algorithm") != "mldg" or num_domains is None:
        return None
    if not (checks.is_int(n_meta_test) and n_meta_test >= 1):
        return None  # named by the field's own check
    return mldg_split_problem(n_meta_test, num_domains)


# Settings of a part of the run that a switch turns on: (the key prefix, the switch, the
# part's name). Their keys are read only when the switch is True.
SWITCHED = (("swad_", "swad", "SWAD"), ("mixstyle_", "mixstyle", "MixStyle"))


def unused_setting_problems(config: ml_collections.ConfigDict, given: Iterable[str]) -> list[str]:
    """For each key of ``given`` (those the user set: the command line's ``--config.KEY``)
    that belongs to a method this run leaves out, one line naming the method: an
    objective's or update rule's own hyperparameter (``methods.owners``) while neither
    ``config.objective`` nor ``config.algorithm`` is one of its owners; DISAM's
    ``disam_descent`` while ``disam_lambda`` is 0; a SWAD or MixStyle setting while that
    is off. Such a value would be accepted and never read. A config file's own values
    (``configs/pacs.py``'s alpha under ``--config.algorithm=sam``) are not given."""
    objective, algorithm = config.get("objective"), config.get("algorithm")
    if objective not in OBJECTIVES or algorithm not in UPDATE_RULES:
        return []  # named by the fields' own checks
    problems = []
    for key in dict.fromkeys(given):
        flag = f"--config.{key}={flag_value(config.get(key))}"
        if key == "disam_descent" and algorithm in owners(key):
            if config.get("disam_lambda") == 0:
                problems.append(
                    f"{flag}: DISAM's setting, and DISAM is off (config.disam_lambda=0); add "
                    "--config.disam_lambda=LAMBDA > 0 (DISAM on SAGM), or leave "
                    f"--config.{key} out."
                )
            continue
        switched = [(s, name) for prefix, s, name in SWITCHED if key.startswith(prefix)]
        if switched and config.get(switched[0][0]) is not True:
            switch, name = switched[0]
            problems.append(
                f"{flag}: {name}'s setting, and {name} is off; add --config.{switch}=True, "
                f"or leave --config.{key} out."
            )
        elif (problem := _owner_problem(key, objective, algorithm)) is not None:
            problems.append(f"{flag}: {problem}")
    return problems


def _owner_problem(key: str, objective: str, algorithm: str) -> str | None:
    """Why method hyperparameter ``key`` is not read by ``objective`` x ``algorithm``."""
    names = owners(key)
    if not names or {objective, algorithm} & set(names):
        return None  # shared (lr, dropout), or the run's own
    parts, switches = [], []
    for what, table, flag in (
        ("objective", OBJECTIVES, "objective"), ("update rule", UPDATE_RULES, "algorithm")
    ):
        mine = [n for n in names if n in table]
        if mine:
            parts.append(f"{what}{'s' if len(mine) > 1 else ''} {', '.join(mine)}")
            more = f" (or {', '.join(mine[1:])})" if len(mine) > 1 else ""
            switches.append(f"--config.{flag}={mine[0]}{more}")
    return (
        f"{key} is a hyperparameter of {' and '.join(parts)}, not of this run's objective "
        f"{objective} and update rule {algorithm}; add {' or '.join(switches)}, or leave "
        f"--config.{key} out."
    )


def device_batch_problems(
    config: ml_collections.ConfigDict, device_count: int | None, num_domains: int | None = None
) -> list[str]:
    """The batches a run shards over its devices that do not divide among them: the
    training batch (``batch_per_env`` x the training environments) and a set
    ``eval_batch_size``. The devices are ``config.num_devices``, or all ``device_count``
    of them (0); ``num_domains`` gives an image folder's domain count (the registry's
    datasets know theirs). Nothing where a count is unknown or a value invalid (named by
    the fields' own checks)."""
    num_devices, batch = config.get("num_devices"), config.get("batch_per_env")
    if not (checks.is_int(num_devices) and checks.is_int(batch) and batch >= 1):
        return []
    devices = num_devices or device_count
    train_envs = training_environments(config, num_domains)
    if not devices or devices < 1 or (device_count and devices > device_count):
        return []
    which = "every device" if not num_devices else f"config.num_devices={num_devices}"
    problems = []
    if train_envs and (batch * train_envs) % devices:
        fits = next(b for b in range(batch, batch + devices + 1) if b * train_envs % devices == 0)
        problems.append(
            f"config.batch_per_env={batch} x {train_envs} training environments = "
            f"{batch * train_envs} examples per step do not divide among the {devices} devices "
            f"({which}), which each take an equal share; use --config.batch_per_env={fits}, "
            "or --config.num_devices=N with N dividing the step's examples."
        )
    eval_batch = config.get("eval_batch_size")
    if checks.is_int(eval_batch) and eval_batch > 0 and eval_batch % devices:
        problems.append(
            f"config.eval_batch_size={eval_batch} does not divide among the {devices} devices "
            f"({which}); use a multiple of {devices}, or 0 (the default per device)."
        )
    return problems

