"""The sweep's job grid: which runs a sweep holds, where each lives, and how far it got.

A job is one argument set: the config file of its dataset, then config overrides
(``algorithm``, ``test_envs``, ``trial_seed``, ``seed`` = the trial seed, one point of
the hyperparameter grid of its preset and dataset (:func:`preset_grid`) or, in a random
search, ``hparams_seed`` = k and setting k's draws (``sagm_jax.sweep.hparams``), and every
``--set``; ``objective`` and ``disam_lambda`` only
where they are not the defaults erm and 0, so that the jobs of a sweep launched before
those existed keep their names). As in DomainBed, its directory is
``<output_dir>/<md5 of json.dumps(args, sort_keys=True)>``, with the arguments in
``args.json`` there, so the same grid always names the same directories. The run
directory inside is ``sagm_jax.training.rundir``'s; the job folder adds ``args.json``,
``out.txt`` / ``err.txt`` (the job's output, one header per launch) and the
launcher's claim ``launcher.lock``. ``<output_dir>/packs/`` holds the files of the
processes that train several jobs at once (``launch --pack``, ``sagm_jax.sweep.packs``).
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import shutil
import sys

from sagm_jax import claims, methods
from sagm_jax.sweep import hparams
from sagm_jax.training import rundir
from sagm_jax.data import registry, splits
from sagm_jax.formatting import flag_value

# The datasets a sweep can run: those of the registry with a config file. An
# ImageFolder's environments are the domain folders of its data_dir (``--set data_dir``).
CONFIG_FILES = dict(registry.CONFIG_FILES)
DATASET_OF = {path: name for name, path in CONFIG_FILES.items()}

# The --hparams presets (:func:`preset_grid`), each per dataset. "paper" keeps each
# config file's own (the paper's per-dataset) hyperparameters. "reduced" is the paper's
# search space for the other methods (docs/protocol.md) on the ResNet datasets, and on
# the MNIST-like ones (the MNIST CNN: no dropout, DomainBed fixes weight decay at 0) a
# search around DomainBed's MNIST lr 1e-3, inside its draw 10^U(-4.5, -2.5). "swad" is
# the SWAD authors' 18-point grid (khanrc/swad#3), for the ResNet datasets, searched with
# trial seed 0 only. "random" is DomainBed's random search (sagm_jax.sweep.hparams), one job
# per hparams_seed 0..n_hparams-1.
PRESETS = ("paper", "reduced", "swad", "random")
REDUCED_RESNET = {
    "lr": [1e-5, 3e-5, 5e-5],
    "dropout": [0.0, 0.1, 0.5],
    "weight_decay": [1e-4, 1e-6],
    "alpha": [1e-3, 5e-4],
}
REDUCED_MNIST = {"lr": [3e-4, 1e-3, 3e-3], "alpha": [1e-3, 5e-4]}
SWAD_GRID = {
    "lr": [1e-5, 3e-5, 5e-5],
    "dropout": [0.0, 0.1, 0.5],
    "weight_decay": [1e-4, 1e-6],
}
SWAD_TRIAL_SEEDS = [0]
# DomainBed's sweep draws 20 settings per method, dataset and trial.
DEFAULT_N_HPARAMS = 20
# What every job's arguments hold besides its grid point and --set keys; a random
# search's jobs add HPARAMS_SEED, the index of their setting.
SWEEP_KEYS = ("config", "algorithm", "test_envs", "trial_seed", "seed")
HPARAMS_SEED = "hparams_seed"
# The sweep's axes that a job holds only where they differ from these defaults.
DEFAULT_AXES = {"objective": "erm", "disam_lambda": 0.0}

DONE, RUNNING, INCOMPLETE, NOT_LAUNCHED = "done", "running", "incomplete", "not launched"
ARGS = "args.json"  # the job's arguments, in its folder
CLAIM = "launcher.lock"  # held by the launcher that runs the job, and by the job's process
OUT, ERR = "out.txt", "err.txt"
PACKS = "packs"  # <output_dir>/packs/<id>/: the packs' files (sagm_jax.sweep.packs)


def num_environments(dataset: str, fixed: dict | None = None) -> int:
    """The environments of ``dataset``: its published domains, or for a dataset without
    them (ImageFolder) the domain folders of ``--set data_dir`` (``fixed["data_dir"]``)."""
    spec = registry.get_spec(dataset)
    if spec.domains:
        return len(spec.domains)
    data_dir = (fixed or {}).get("data_dir")
    if not isinstance(data_dir, str) or not data_dir:
        raise ValueError(
            f"--datasets {dataset} needs --set data_dir=DIR: the folder whose sub-folders "
            "are the domains (DIR/<domain>/<class>/<image>); its domains are the sweep's "
            "environments."
        )
    root = registry.dataset_root(spec, data_dir)
    domains = splits.list_domains(root) if os.path.isdir(root) else []
    if len(domains) < 2:
        raise ValueError(
            f"--set data_dir={data_dir}: expected a folder of at least two domain folders "
            f"({spec.missing_help(data_dir)}); found "
            + (f"{len(domains)} in {root}." if os.path.isdir(root) else "no such folder.")
        )
    return len(domains)


def test_env_sets(specs: list[str], n_envs: int) -> list[list[int]]:
    """``all``, ``all_with_pairs`` (DomainBed's ``all_test_env_combinations``) or
    explicit comma-separated sets."""
    sets = []
    for spec in specs:
        if spec == "all":
            sets += [[i] for i in range(n_envs)]
        elif spec == "all_with_pairs":
            for i in range(n_envs):
                sets += [[i]] + [[i, j] for j in range(i + 1, n_envs)]
        else:
            try:
                envs = sorted(int(e) for e in spec.split(","))
            except ValueError:
                raise ValueError(
                    f"--test_envs {spec!r}: expected all, all_with_pairs or "
                    "environment indices such as 0 or 0,1."
                ) from None
            if any(not 0 <= e < n_envs for e in envs):
                raise ValueError(f"--test_envs {spec!r}: indices must be in 0..{n_envs - 1}.")
            sets.append(envs)
    return sets


def parse_value(text: str):
    """``1e-5`` -> 1e-05, ``True`` -> True, ``(0, 1)`` -> [0, 1]; anything else a string."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return list(value) if isinstance(value, tuple) else value


def parse_assignments(items: list[str], flag: str) -> dict[str, list]:
    """``["lr=1e-5,3e-5", "steps=301"]`` -> ``{"lr": [1e-05, 3e-05], "steps": [301]}``.
    Every ``--set`` / ``--grid`` item adds a key; a key given twice is an error."""
    result, given = {}, {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE[,VALUE...].")
        if key in given:
            raise ValueError(
                f"{flag} {key} is given twice ({given[key]} and {item}); give each key once."
            )
        given[key] = item
        result[key] = (
            [parse_value(v) for v in values.split(",")]
            if flag == "--grid"
            else [parse_value(values)]
        )
    return result


def grid_points(grid: dict[str, list], algorithm: str, objective: str = "erm") -> list[dict]:
    """Every combination of the grid's values, without the keys that neither the
    objective nor the update rule uses (a method hyperparameter is its owners' in
    ``sagm_jax.methods``: ``alpha`` is SAGM's alone, erm_sam being SAGM with alpha 0; a key
    no method owns, such as lr or dropout, is every method's)."""
    keys = sorted(
        k for k in grid if not (owners := methods.owners(k)) or {algorithm, objective} & set(owners)
    )
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def method_combinations(objectives, algorithms, disam_lambdas) -> tuple[list, list[str]]:
    """The product ``objectives x algorithms x disam_lambdas`` as ``(objective,
    algorithm, disam_lambda)`` triples, without those ``methods.combination_problem``
    refuses; and one line per refused triple, saying why. ``ValueError`` on an unknown
    name or a negative lambda."""
    for flag, names, table in (
        ("--objectives", objectives, methods.OBJECTIVES),
        ("--algorithms", algorithms, methods.UPDATE_RULES),
    ):
        for name in names:
            if name not in table:
                raise ValueError(f"{flag} {name!r}: expected one of {', '.join(table)}.")
    if any(float(value) < 0 for value in disam_lambdas):
        raise ValueError(f"--disam_lambdas {disam_lambdas}: each must be >= 0 (0 = off).")
    kept, skipped = [], []
    for objective, algorithm, disam in itertools.product(objectives, algorithms, disam_lambdas):
        problem = methods.combination_problem(objective, algorithm, float(disam))
        if problem:
            skipped.append(
                f"skipped objective={objective} algorithm={algorithm} "
                f"disam_lambda={flag_value(float(disam))}: {problem}"
            )
        else:
            kept.append((objective, algorithm, float(disam)))
    return kept, skipped


def job_hash(args: dict) -> str:
    """DomainBed's job name: md5 of the sorted, JSON-serialized arguments."""
    return hashlib.md5(json.dumps(args, sort_keys=True).encode("utf-8")).hexdigest()


class Job:
    """One run: its arguments, its directory and its command."""

    def __init__(self, args: dict, output_dir: str):
        self.args = args
        self.directory = os.path.join(os.path.abspath(output_dir), job_hash(args))

    def command(self) -> list[str]:
        overrides = [
            f"--config.{key}={flag_value(value)}"
            for key, value in sorted(self.args.items())
            if key != "config"
        ]
        return [
            sys.executable,
            "-m",
            "sagm_jax.main",
            f"--config={self.args['config']}",
            f"--workdir={self.directory}",
            *overrides,
        ]

    def is_done(self) -> bool:
        return os.path.exists(os.path.join(self.directory, rundir.DONE))

    def status(self) -> str:
        if self.is_done():
            return DONE
        if claims.is_claimed(self.directory, CLAIM) or claims.is_claimed(
            self.directory, rundir.RUN_LOCK
        ):
            return RUNNING
        return INCOMPLETE if os.path.exists(self.directory) else NOT_LAUNCHED

    def describe(self, extra_keys=()) -> str:
        """``PACS sagm test_envs=0 trial_seed=1 lr=3e-05``: which job this is."""
        args = self.args
        words = [
            DATASET_OF.get(args.get("config"), str(args.get("config"))),
            str(args.get("algorithm")),
            "test_envs=" + ",".join(str(e) for e in args.get("test_envs", [])),
            f"trial_seed={args.get('trial_seed')}",
        ]
        return " ".join(words + [f"{k}={flag_value(args[k])}" for k in extra_keys if k in args])


def preset_grid(preset: str, dataset: str) -> dict[str, list]:
    """The grid of ``--hparams preset`` for ``dataset`` (:data:`PRESETS`): ``{}`` for
    "paper" and "random" (a random search sets its points itself)."""
    if preset not in PRESETS:
        raise ValueError(f"--hparams {preset!r}: expected one of {', '.join(PRESETS)}.")
    mnist = hparams.is_mnist_like(dataset)
    if preset == "reduced":
        return REDUCED_MNIST if mnist else REDUCED_RESNET
    if preset == "swad":
        if mnist:
            raise ValueError(
                f"--hparams swad with {dataset}: the SWAD authors' grid (lr, ResNet dropout, "
                "weight decay) is for the ResNet datasets; search the MNIST CNN with "
                "--hparams reduced or --hparams random."
            )
        return SWAD_GRID
    return {}


def preset_trial_seeds(preset: str, trial_seeds) -> list[int]:
    """The trial seeds a preset searches with: the SWAD authors searched their grid once,
    with trial seed 0 (:data:`SWAD_TRIAL_SEEDS`); the other presets take them all."""
    return list(SWAD_TRIAL_SEEDS) if preset == "swad" else list(trial_seeds)


def _check_random_search(grid, fixed, disam_lambdas, n_hparams) -> None:
    """A random search names each setting by its index ``hparams_seed``: a --grid would
    give one index several settings, and two DISAM lambdas the same drawn jobs."""
    if grid:
        raise ValueError(
            f"--grid {', '.join(sorted(grid))} with --hparams random: each job's "
            "hyperparameters are drawn; use --set to fix a key for every job."
        )
    if HPARAMS_SEED in fixed:
        raise ValueError(f"--set {HPARAMS_SEED}: set by --hparams random (0..n_hparams-1).")
    if len({float(v) for v in disam_lambdas if float(v) > 0}) > 1:
        raise ValueError(
            f"--disam_lambdas {' '.join(str(v) for v in disam_lambdas)} with --hparams "
            "random: the search draws DISAM's lambda (setting 0 takes the value given); "
            "give 0 and/or one positive value."
        )
    if not (isinstance(n_hparams, int) and n_hparams >= 1):
        raise ValueError(f"--n_hparams {n_hparams}: expected a positive integer.")


def _points(dataset, objective, algorithm, disam, trial_seed, grid, preset, n_hparams, arch):
    """The hyperparameter points of one method's jobs: the preset's grid with the
    ``--grid`` keys over it, or the random search's settings ``hparams_seed`` 0..n-1."""
    if preset != "random":
        merged = {**preset_grid(preset, dataset), **grid}
        return grid_points(merged, algorithm, objective)
    return [
        {
            HPARAMS_SEED: k,
            **hparams.random_hparams(algorithm, dataset, k, trial_seed, objective, disam,
                                     arch=arch),
        }
        for k in range(n_hparams)
    ]


def make_jobs(
    datasets,
    algorithms,
    test_envs,
    trial_seeds,
    grid,
    fixed,
    output_dir,
    objectives=("erm",),
    disam_lambdas=(0.0,),
    hparams_preset="paper",
    n_hparams=DEFAULT_N_HPARAMS,
) -> list[Job]:
    """The sweep's jobs, in a fixed order, for every combination that
    :func:`method_combinations` keeps. ``grid`` maps keys to value lists (``--grid``,
    over the preset's grid, :func:`preset_grid`); ``fixed`` maps keys to one value each
    (``--set``). ``hparams_preset="random"``: ``n_hparams`` settings per method, dataset
    and trial seed; "swad": trial seed 0 only (:func:`preset_trial_seeds`)."""
    # The sweep itself sets these (and the grid its keys); a --set of one would give
    # several jobs the same arguments.
    axes = set(SWEEP_KEYS) | set(DEFAULT_AXES)
    for flag, clash in (("--set", set(fixed) & (axes | set(grid))), ("--grid", set(grid) & axes)):
        if clash:
            raise ValueError(
                f"{flag} {', '.join(sorted(clash))}: set by the sweep's own options "
                "(--algorithms, --objectives, --disam_lambdas, --test_envs, --trial_seeds, "
                "--grid / --hparams)."
            )
    for dataset in datasets:
        if dataset not in CONFIG_FILES:
            raise ValueError(f"--datasets {dataset!r}: expected one of {', '.join(CONFIG_FILES)}.")
        preset_grid(hparams_preset, dataset)  # refuses a preset the dataset has not
    if hparams_preset == "random":
        _check_random_search(grid, fixed, disam_lambdas, n_hparams)
    combinations, _ = method_combinations(objectives, algorithms, disam_lambdas)
    jobs = []
    for dataset, (objective, algorithm, disam) in itertools.product(datasets, combinations):
        method = {"objective": objective, "disam_lambda": disam}
        method = {k: v for k, v in method.items() if v != DEFAULT_AXES[k]}
        for envs in test_env_sets(test_envs, num_environments(dataset, fixed)):
            for trial_seed in preset_trial_seeds(hparams_preset, trial_seeds):
                draw = (objective, algorithm, disam, trial_seed)
                for point in _points(dataset, *draw, grid, hparams_preset, n_hparams,
                                     fixed.get("arch")):
                    args = {
                        "config": CONFIG_FILES[dataset],
                        "algorithm": algorithm,
                        **method,
                        "test_envs": envs,
                        "trial_seed": trial_seed,
                        "seed": trial_seed,
                        **point,
                        **fixed,
                    }
                    jobs.append(Job(args, output_dir))
    return jobs


def values_by_key(jobs: list[Job]) -> dict[str, set[str]]:
    """``{key: {JSON of each value the jobs give it}}``; a job without the key gives it
    ``null``."""
    keys = {k for job in jobs for k in job.args}
    return {k: {json.dumps(job.args.get(k)) for job in jobs} for k in keys}


def varying_keys(jobs: list[Job], exclude=()) -> list[str]:
    """The keys whose values differ between the jobs, but those in ``exclude``."""
    return sorted(k for k, v in values_by_key(jobs).items() if len(v) > 1 and k not in exclude)


def status_table(jobs: list[Job], output_dir: str) -> str:
    """One row per job (status, hash, last evaluated step, and the arguments that
    vary), then the totals."""
    last_steps = {run.path: run.last_step for run in rundir.find_runs(output_dir)}
    varying = varying_keys(jobs)
    header = ["status", "job", "step", *varying]
    rows = [
        [
            job.status(),
            os.path.basename(job.directory)[:10],
            str(last_steps.get(job.directory, "-")),
            *[json.dumps(job.args.get(k)) for k in varying],
        ]
        for job in jobs
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    counts = {
        s: sum(1 for r in rows if r[0] == s) for s in (DONE, RUNNING, INCOMPLETE, NOT_LAUNCHED)
    }
    lines.append(f"{len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def unknown_folders(jobs: list[Job], output_dir: str) -> list[str]:
    """A line for each folder of ``output_dir`` that is not a job of this grid, saying
    why: its arguments that no job of the grid has (usually another --set or --grid)."""
    if not os.path.isdir(output_dir):
        return []
    known = {os.path.basename(job.directory) for job in jobs}
    values = values_by_key(jobs)
    lines = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if name.startswith(".") or name in known or name == PACKS or not os.path.isdir(path):
            continue
        if not os.path.exists(os.path.join(path, ARGS)):
            lines.append(f"{name[:10]}  not a job folder (no {ARGS})")
            continue
        with open(os.path.join(path, ARGS)) as f:
            args = json.load(f)
        differences = []
        for key in sorted(set(args) | set(values)):
            value = json.dumps(args.get(key))
            grid = values.get(key, {"null"})
            if value not in grid:
                shown = ", ".join(sorted(v if v != "null" else "unset" for v in grid))
                given = value if key in args else "unset"
                differences.append(f"{key}={given} (this grid: {shown})")
        status = Job(args, output_dir).status()
        why = "; ".join(differences) or "arguments match, but not its folder name"
        lines.append(f"{name[:10]}  {status:<12}  {why}")
    return lines


def delete_incomplete(jobs: list[Job]) -> list[Job]:
    deleted = [job for job in jobs if job.status() == INCOMPLETE]
    for job in deleted:
        shutil.rmtree(job.directory)
    return deleted
