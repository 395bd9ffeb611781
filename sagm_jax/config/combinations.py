"""The checks of combinations of config keys: what a method, MixStyle's cross-domain mix
and MLDG's split need of the rest of the config, one line per problem, naming the keys
and what to set instead (``config_problems`` gathers them with the fields' own checks)."""

from __future__ import annotations

import ml_collections

from sagm_jax.config import checks
from sagm_jax.data.registry import DATASETS
from sagm_jax.methods.procedures import mldg_split_problem
from sagm_jax.methods.registry import OBJECTIVES, UPDATE_RULES, combination_problem, rule_names


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
                        "is cut in two halves; use an even batch_per_env.")
    if config.get("perturbation") == "per_device":
        problems.append(f"{flag} with config.perturbation=per_device: a shard holds part of "
                        "each domain; use --config.perturbation=global.")
    if config.get("algorithm") in rule_names("procedure"):
        problems.append(f"{flag} with config.algorithm={config.get('algorithm')}: the "
                        "procedures forward in passes of their own; use another update rule.")
    return problems


def training_environments(config: ml_collections.ConfigDict) -> int | None:
    """How many environments a run of ``config`` trains on, from the dataset registry
    and ``test_envs`` (``all_test_envs``: each run holds one out); None where the
    domains are known only once the data is listed (an image folder) or the values
    are invalid (named by the fields' own checks)."""
    spec = DATASETS.get(config.get("dataset"))
    if spec is None or not spec.domains:
        return None
    if config.get("all_test_envs") is True:
        return len(spec.domains) - 1
    test_envs = config.get("test_envs")
    if checks.test_envs(test_envs, config, None):
        return None
    return len(spec.domains) - len(test_envs)


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
