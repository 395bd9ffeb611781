"""Sweep launcher: a grid of ``python -m sagm_jax.main`` jobs, launched, resumed and listed.

    python experiments/sweep.py launch --datasets RotatedDigits \
        --algorithms erm sam gsam sagm --test_envs all --trial_seeds 0 1 2 \
        --output_dir sweeps/digits --jobs 2 [--hparams paper|reduced] \
        [--grid lr=1e-5,3e-5] [--set steps=301 ...] [--gpus 0,1] [--dry_run]
    python experiments/sweep.py status ...same grid arguments...
    python experiments/sweep.py delete_incomplete ...same grid arguments... [--yes]

A job is one argument set: the config file of its dataset, then config overrides
(``algorithm``, ``test_envs``, ``trial_seed``, ``seed`` = the trial seed, one point
of the hyperparameter grid, and every ``--set``). As in DomainBed, its directory is
``<output_dir>/<md5 of json.dumps(args, sort_keys=True)>``, with the arguments in
``args.json`` there, so the same grid always names the same directories.

``launch`` skips finished jobs (``done`` exists) and relaunches every other one; an
interrupted run resumes from its checkpoint. Jobs run ``--jobs N`` at a time, or one
per GPU with ``--gpus 0,1,...`` (each worker sets ``CUDA_VISIBLE_DEVICES`` to its
GPU). A job's stdout and stderr go to ``out.txt`` / ``err.txt`` in its directory; a
failing job does not stop the others and is reported at the end (exit status 1).

Test environments: ``all`` (each environment alone), ``all_with_pairs`` (each
alone and every pair, as DomainBed's sweep; leave-one-domain-out selection needs
the pairs), or explicit sets such as ``0 1 0,1``.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import hashlib
import itertools
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG_FILES = {
    "PACS": "configs/pacs.py",
    "VLCS": "configs/vlcs.py",
    "OfficeHome": "configs/office_home.py",
    "TerraIncognita": "configs/terra_incognita.py",
    "DomainNet": "configs/domain_net.py",
    "RotatedMNIST": "configs/rotated_mnist.py",
    "ColoredMNIST": "configs/colored_mnist.py",
    "RotatedDigits": "configs/rotated_digits.py",
}
ALGORITHMS = ("erm", "sam", "gsam", "sagm", "erm_sam")

# The paper's search space for the other methods (protocol doc); "paper" keeps each
# config file's own (the paper's per-dataset) hyperparameters.
PRESETS = {
    "paper": {},
    "reduced": {
        "lr": [1e-5, 3e-5, 5e-5],
        "dropout": [0.0, 0.1, 0.5],
        "weight_decay": [1e-4, 1e-6],
        "alpha": [1e-3, 5e-4],
    },
}
# Hyperparameters an algorithm ignores are not swept for it (no duplicate runs).
USED_BY = {
    "alpha": ("sagm", "gsam"),
    "rho": ("sam", "gsam", "sagm", "erm_sam"),
    "combine": ("sagm", "erm_sam"),
}

DONE, NOT_LAUNCHED, INCOMPLETE = "done", "not launched", "incomplete"


def num_environments(dataset: str) -> int:
    from sagm_jax.data import mnist, registry

    if dataset in ("RotatedMNIST", "RotatedDigits"):
        return len(mnist.ROTATIONS)
    if dataset == "ColoredMNIST":
        return len(mnist.COLOR_ENV_NAMES)
    return len(registry.get_spec(dataset).domains)


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
    """``["lr=1e-5,3e-5", "steps=301"]`` -> ``{"lr": [1e-05, 3e-05], "steps": [301]}``."""
    result = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE[,VALUE...].")
        result[key] = (
            [parse_value(v) for v in values.split(",")]
            if flag == "--grid"
            else [parse_value(values)]
        )
    return result


def grid_points(grid: dict[str, list], algorithm: str) -> list[dict]:
    """Every combination of the grid's values, without keys the algorithm ignores."""
    keys = sorted(k for k in grid if algorithm in USED_BY.get(k, ALGORITHMS))
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


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
            f"--config.{key}={render(value)}"
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

    def status(self) -> str:
        if os.path.exists(os.path.join(self.directory, "done")):
            return DONE
        return INCOMPLETE if os.path.exists(self.directory) else NOT_LAUNCHED


def render(value) -> str:
    """A value as ml-collections parses it from ``--config.key=``: lists as tuples."""
    return repr(tuple(value)) if isinstance(value, list) else str(value)


def make_jobs(datasets, algorithms, test_envs, trial_seeds, grid, fixed, output_dir) -> list[Job]:
    """The sweep's jobs, in a fixed order. ``grid`` maps keys to value lists; ``fixed``
    maps keys to one value each (``--set``)."""
    # The sweep itself sets these (and the grid its keys); a --set of one would give
    # several jobs the same arguments.
    clash = sorted(
        set(fixed) & ({"config", "algorithm", "test_envs", "trial_seed", "seed"} | set(grid))
    )
    if clash:
        raise ValueError(
            f"--set {', '.join(clash)}: set by the sweep's own options "
            "(--algorithms, --test_envs, --trial_seeds, --grid / --hparams)."
        )
    jobs = []
    for dataset in datasets:
        if dataset not in CONFIG_FILES:
            raise ValueError(f"--datasets {dataset!r}: expected one of {', '.join(CONFIG_FILES)}.")
        for algorithm in algorithms:
            if algorithm not in ALGORITHMS:
                raise ValueError(
                    f"--algorithms {algorithm!r}: expected one of {', '.join(ALGORITHMS)}."
                )
            for envs in test_env_sets(test_envs, num_environments(dataset)):
                for trial_seed in trial_seeds:
                    for point in grid_points(grid, algorithm):
                        args = {
                            "config": CONFIG_FILES[dataset],
                            "algorithm": algorithm,
                            "test_envs": envs,
                            "trial_seed": trial_seed,
                            "seed": trial_seed,
                            **point,
                            **fixed,
                        }
                        jobs.append(Job(args, output_dir))
    return jobs


def run_job(job: Job, command: list[str], gpu: str | None) -> int:
    os.makedirs(job.directory, exist_ok=True)
    with open(os.path.join(job.directory, "args.json"), "w") as f:
        json.dump(job.args, f, indent=2, sort_keys=True)
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    with (
        open(os.path.join(job.directory, "out.txt"), "w") as out,
        open(os.path.join(job.directory, "err.txt"), "w") as err,
    ):
        return subprocess.run(command, stdout=out, stderr=err, cwd=REPO, env=env).returncode


def launch(
    jobs: list[Job],
    workers: int = 1,
    gpus: list[str] | None = None,
    make_command=Job.command,
    log=print,
) -> dict:
    """Runs every job that is not done. Returns ``{"skipped": [...], "finished": [...],
    "failed": [(job, exit code), ...]}``."""
    pending = [job for job in jobs if job.status() != DONE]
    result = {
        "skipped": [job for job in jobs if job.status() == DONE],
        "finished": [],
        "failed": [],
    }
    free_gpus = queue.Queue()
    for gpu in gpus or []:
        free_gpus.put(gpu)

    def work(job):
        gpu = free_gpus.get() if gpus else None
        try:
            return run_job(job, make_command(job), gpu)
        finally:
            if gpus:
                free_gpus.put(gpu)

    log(f"{len(result['skipped'])} of {len(jobs)} jobs done already; launching {len(pending)}.")
    with concurrent.futures.ThreadPoolExecutor(len(gpus) if gpus else workers) as pool:
        futures = {pool.submit(work, job): job for job in pending}
        for future in concurrent.futures.as_completed(futures):
            job = futures[future]
            try:
                code = future.result()
            except OSError as error:  # the command could not start
                code = f"{type(error).__name__}: {error}"
            if code == 0:
                result["finished"].append(job)
                log(f"finished {job.directory}")
            else:
                result["failed"].append((job, code))
                log(f"FAILED ({code}) {job.directory}: see err.txt there")
    return result


def status_table(jobs: list[Job]) -> str:
    """One row per job (status, hash, and the arguments that vary), then the totals."""
    varying = [
        key
        for key in sorted({k for job in jobs for k in job.args})
        if len({json.dumps(job.args.get(key)) for job in jobs}) > 1
    ]
    header = ["status", "job", *varying]
    rows = [
        [
            job.status(),
            os.path.basename(job.directory)[:10],
            *[json.dumps(job.args.get(k)) for k in varying],
        ]
        for job in jobs
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    counts = {s: sum(1 for r in rows if r[0] == s) for s in (DONE, INCOMPLETE, NOT_LAUNCHED)}
    lines.append(f"{len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def delete_incomplete(jobs: list[Job]) -> list[Job]:
    deleted = [job for job in jobs if job.status() == INCOMPLETE]
    for job in deleted:
        shutil.rmtree(job.directory)
    return deleted


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["launch", "status", "delete_incomplete"])
    parser.add_argument("--datasets", nargs="+", required=True)
    parser.add_argument("--algorithms", nargs="+", default=["sagm"])
    parser.add_argument("--test_envs", nargs="+", default=["all"])
    parser.add_argument("--trial_seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--hparams",
        choices=sorted(PRESETS),
        default="paper",
        help="paper: each config's own values; reduced: the paper's search space.",
    )
    parser.add_argument(
        "--grid",
        nargs="*",
        default=[],
        metavar="KEY=V1,V2",
        help="More swept values (override the preset's for that key).",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Config overrides for every job (part of the job's hash).",
    )
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--jobs", type=int, default=1, help="Jobs at a time (without --gpus).")
    parser.add_argument("--gpus", help="Comma-separated GPU ids: one worker per GPU.")
    parser.add_argument("--dry_run", action="store_true", help="List the commands; run nothing.")
    parser.add_argument("--yes", action="store_true", help="delete_incomplete without asking.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        grid = {**PRESETS[args.hparams], **parse_assignments(args.grid, "--grid")}
        fixed = {k: v[0] for k, v in parse_assignments(args.set, "--set").items()}
        jobs = make_jobs(
            args.datasets,
            args.algorithms,
            args.test_envs,
            args.trial_seeds,
            grid,
            fixed,
            args.output_dir,
        )
    except ValueError as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 2
    if args.command == "status":
        print(status_table(jobs))
    elif args.command == "delete_incomplete":
        incomplete = [job for job in jobs if job.status() == INCOMPLETE]
        if (
            not args.yes
            and input(f"Delete {len(incomplete)} incomplete job directories? [y/N] ")
            .strip()
            .lower()
            != "y"
        ):
            return 1
        print(f"Deleted {len(delete_incomplete(jobs))} incomplete job directories.")
    elif args.dry_run:
        for job in jobs:
            print(f"[{job.status()}] " + shlex.join(job.command()))
    else:
        gpus = args.gpus.split(",") if args.gpus else None
        result = launch(jobs, workers=args.jobs, gpus=gpus)
        print(
            f"Summary: {len(result['finished'])} finished, {len(result['skipped'])} skipped "
            f"(done), {len(result['failed'])} failed."
        )
        for job, code in result["failed"]:
            print(f"  failed ({code}): {job.directory}")
        return 1 if result["failed"] else 0
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
