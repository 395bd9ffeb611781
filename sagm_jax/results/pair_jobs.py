"""The runs that leave-one-domain-out still needs (:func:`missing_pairs`), and the
commands that launch exactly those (:func:`commands`).

Leave-one-domain-out (``selection.leave_one_out_run``) scores the single run ``(t,)`` of
a setting with the pair runs ``(t, v)`` of the SAME setting, one for each other
environment ``v``. A missing pair run is therefore the single run's own job with
``test_envs = sorted((t, v))``, and nothing else:

- a sweep's job (its folder holds ``args.json``, ``sagm_jax.sweep.jobs``): its arguments
  with the pair's ``test_envs``, in the sweep's output folder (the single run's parent);
- a run of ``python -m sagm_jax.main``: the config file of its dataset with, as
  overrides, the keys of its recorded ``config`` whose value is not that file's (the
  command line it was launched with, less what it left at the defaults), in
  ``--input_dir``.

:func:`commands` writes those jobs as ``python -m sagm_jax.sweep launch`` commands, as
few as it can: it tries one command for all the jobs of an output folder (every
``--set`` key the jobs share, ``--grid`` for the keys whose values differ, the pairs as
explicit ``--test_envs`` sets such as ``0,1 0,2``), keeps it when the sweep's own job
list (``sagm_jax.sweep.__main__.make_jobs``) is exactly those jobs, and otherwise splits
them by dataset, then by objective and DISAM lambda, update rule, setting and trial
seed, trying again at each level. A job no sweep command holds (its ``seed`` is not its
``trial_seed``, or its dataset has no config file) gets its own ``python -m
sagm_jax.main`` command. DomainBed's runs (records without ``config``) are named, not
launched: DomainBed's sweep adds them.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import shlex

from sagm_jax import methods
from sagm_jax.data import registry
from sagm_jax.formatting import flag_value
from sagm_jax.results.records import is_domainbed, method_of
from sagm_jax.sweep import jobs as jobs_lib, preflight

Needed = collections.namedtuple("Needed", "cells jobs")
# What a job's arguments hold besides its setting: the sweep's axes.
AXES = set(jobs_lib.SWEEP_KEYS) | set(jobs_lib.DEFAULT_AXES)
# Keys of a recorded config that are not overrides of its config file.
NOT_OVERRIDES = AXES | {"dataset", "all_test_envs"}


def missing_pairs(loaded, input_dir: str) -> Needed:
    """``cells``: ``{(dataset, method): [test environments t]}`` where some setting with
    the single run ``(t,)`` lacks a pair run ``(t, v)``; ``jobs``: ``{(output folder,
    job hash): arguments}`` of each missing pair run of our runs (module doc).
    ``loaded``: ``records.load_sweep``'s (its finished runs' groups)."""
    cells, jobs = collections.defaultdict(set), {}
    builder = preflight.Builder()
    for group, settings in loaded.groups.items():
        split, dataset, method, _, t = group
        if split != "domainbed":
            continue
        for setting, runs in settings.items():
            if (t,) not in runs:
                continue
            single = runs[(t,)][0]
            n_envs = sum(1 for k in single if k.startswith("env") and k.endswith("_out_acc"))
            absent = [(min(t, v), max(t, v)) for v in range(n_envs) if v != t]
            absent = [pair for pair in absent if pair not in runs]
            if not absent:
                continue
            cells[dataset, method].add(t)
            if is_domainbed(single):
                continue
            path = os.path.join(input_dir, loaded.where[group, setting, (t,)])
            output_dir, args = job_arguments(path, single, input_dir, builder)
            for pair in absent:
                pair_args = {**args, "test_envs": list(pair)}
                jobs[output_dir, jobs_lib.job_hash(pair_args)] = pair_args
    return Needed({key: sorted(envs) for key, envs in cells.items()}, jobs)


def job_arguments(folder: str, record: dict, input_dir: str, builder) -> tuple[str, dict]:
    """``(output folder, arguments)`` of the job that made the run in ``folder``: a
    sweep job's ``args.json``, or the overrides its recorded config makes of its
    dataset's config file (module doc)."""
    args_file = os.path.join(folder, jobs_lib.ARGS)
    if os.path.exists(args_file):
        with open(args_file) as f:
            args = json.load(f)
        if isinstance(args, dict) and "config" in args:
            return os.path.dirname(os.path.abspath(folder)), args
    config = record["config"]
    objective, algorithm, disam = method_of(record)
    dataset = record["args"]["dataset"]
    args = {"config": registry.CONFIG_FILES.get(dataset, dataset), "algorithm": algorithm}
    args.update({"objective": objective, "disam_lambda": disam})
    args = {k: v for k, v in args.items() if jobs_lib.DEFAULT_AXES.get(k) != v}
    trial_seed = int(config.get("trial_seed", record["args"]["trial_seed"]))
    args.update(trial_seed=trial_seed, seed=int(config.get("seed", trial_seed)))
    base, _ = builder.base(args["config"]) if dataset in registry.CONFIG_FILES else (None, None)
    defaults = base.to_dict() if base is not None else {}
    for key, value in config.items():
        if key in NOT_OVERRIDES or key == "test_envs":
            continue
        if key not in defaults or json.dumps(defaults[key]) != json.dumps(value):
            args[key] = value
    return os.path.abspath(input_dir), args


def commands(jobs: dict) -> list[str]:
    """Commands that launch exactly ``jobs`` (``{(output folder, hash): arguments}``),
    each job once: sweep commands as few as one grid allows, ``sagm_jax.main`` for the
    jobs no sweep command holds (module doc)."""
    by_folder = collections.defaultdict(list)
    for (output_dir, _), args in sorted(jobs.items()):
        by_folder[output_dir].append(args)
    return [line for d, group in sorted(by_folder.items()) for line in _cover(group, d, 0)]


# How the jobs are split when one command cannot hold them, coarse to fine; last, the
# trial seeds of one setting by the pairs they lack (:func:`_cover`).
SPLITS = (
    lambda a: a["config"],
    lambda a: (a.get("objective", "erm"), float(a.get("disam_lambda", 0.0))),
    lambda a: a["algorithm"],
    lambda a: json.dumps({k: v for k, v in a.items() if k not in AXES}, sort_keys=True),
    None,
)


def _cover(group: list[dict], output_dir: str, level: int) -> list[str]:
    """One sweep command for ``group`` if one holds it exactly, else the commands of its
    parts by ``SPLITS[level]``; past the last split, a ``sagm_jax.main`` command a job."""
    words = sweep_words(group, output_dir)
    if words is not None and launches_exactly(words, group):
        return [shlex.join(words)]
    if level == len(SPLITS):  # one trial seed, or seeds that lack the same pairs
        return [shlex.join(["python", *jobs_lib.Job(a, output_dir).command()[1:]]) for a in group]
    parts = collections.defaultdict(list)
    if level == len(SPLITS) - 1:  # the trial seeds that lack the same pairs, together
        envs = collections.defaultdict(list)
        for args in group:
            envs[args["trial_seed"], args["seed"]].append(sorted(args["test_envs"]))
        for args in group:
            parts[json.dumps(sorted(envs[args["trial_seed"], args["seed"]]))].append(args)
    else:
        for args in group:
            parts[json.dumps(SPLITS[level](args), sort_keys=True)].append(args)
    return [
        line for _, part in sorted(parts.items()) for line in _cover(part, output_dir, level + 1)
    ]


def _unique(values) -> list:
    seen = {}
    for value in values:
        seen.setdefault(json.dumps(value, sort_keys=True), value)
    return list(seen.values())


def sweep_words(group: list[dict], output_dir: str) -> list[str] | None:
    """The ``sagm_jax.sweep launch`` command whose axes hold every value the ``group``'s
    jobs take, with ``--set`` for the keys they share and ``--grid`` for the others; None
    when no such command can be written (a dataset without a config file, a ``seed``
    that is not the trial seed, a key some jobs lack, a value with a comma)."""
    datasets = _unique(jobs_lib.DATASET_OF.get(a["config"]) for a in group)
    if None in datasets or any(a["seed"] != a["trial_seed"] for a in group):
        return None
    rules, objectives = list(methods.UPDATE_RULES), list(methods.OBJECTIVES)
    algorithms = sorted(_unique(a["algorithm"] for a in group), key=rules.index)
    objective_names = _unique(a.get("objective", "erm") for a in group)
    disams = sorted(_unique(float(a.get("disam_lambda", 0.0)) for a in group))
    seeds = sorted(_unique(a["trial_seed"] for a in group))
    envs = sorted(_unique(sorted(a["test_envs"]) for a in group))
    words = ["python", "-m", "sagm_jax.sweep", "launch", "--datasets", *datasets]
    words += ["--algorithms", *algorithms]
    if objective_names != ["erm"]:
        words += ["--objectives", *sorted(objective_names, key=objectives.index)]
    if disams != [0.0]:
        words += ["--disam_lambdas", *(flag_value(v) for v in disams)]
    words += ["--trial_seeds", *map(str, seeds)]
    words += ["--test_envs", *(",".join(map(str, e)) for e in envs)]
    fixed, grid = [], []
    for key in sorted({k for a in group for k in a} - AXES):
        if any(key not in a for a in group):
            return None
        texts = [flag_value(v) for v in _unique(a[key] for a in group)]
        if any("," in text for text in texts) and len(texts) > 1:
            return None
        (fixed if len(texts) == 1 else grid).append(f"{key}={','.join(texts)}")
    words += ["--set", *fixed] if fixed else []
    words += ["--grid", *grid] if grid else []
    return words + ["--output_dir", output_dir]


def launches_exactly(words: list[str], group: list[dict]) -> bool:
    """Whether the sweep command ``words`` names exactly the jobs of ``group``."""
    from sagm_jax.sweep.__main__ import make_jobs, parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            made = make_jobs(parse_args(words[3:]))
    except (ValueError, SystemExit):
        return False
    hashes = sorted(jobs_lib.job_hash(job.args) for job in made)
    return hashes == sorted(jobs_lib.job_hash(args) for args in group)
