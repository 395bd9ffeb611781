"""Sweep launcher: a grid of ``python -m sagm_jax.main`` jobs, run exactly once each.

    python experiments/sweep.py launch --datasets RotatedDigits \
        --algorithms erm sam gsam sagm --test_envs all --trial_seeds 0 1 2 \
        --output_dir sweeps/digits --jobs 2 [--hparams paper|reduced] \
        [--grid lr=1e-5,3e-5] [--set steps=301 --set eval_every=50 ...] [--gpus 0,1] [--dry_run]
    python experiments/sweep.py launch ...same grid... --launcher slurm --partition gpu \
        --gpus_per_job 1 --time_min 240 [--account A] [--array_parallelism 64]
    python experiments/sweep.py status ...same grid arguments...
    python experiments/sweep.py delete_incomplete ...same grid arguments... [--yes]

A job is one argument set: the config file of its dataset, then config overrides
(``algorithm``, ``test_envs``, ``trial_seed``, ``seed`` = the trial seed, one point
of the hyperparameter grid, and every ``--set``). As in DomainBed, its directory is
``<output_dir>/<md5 of json.dumps(args, sort_keys=True)>``, with the arguments in
``args.json`` there, so the same grid always names the same directories.

Exactly once: a launcher CLAIMS a job before it touches the job's directory
(``sagm_jax.claims``: a lock on ``launcher.lock`` that the kernel drops when its
holder dies) and hands the claim to the job's process. Any number of launchers, on
one machine or on several sharing the file system, therefore run each job once; a
job whose launcher and process have died is claimed again by the next launcher and
resumes from its checkpoint. A launcher that is killed outright (SIGKILL, a lost
terminal) leaves its jobs running with their claims: they finish, and meanwhile
every other launcher reports them as running. Ctrl-C or SIGTERM stops the launcher
AND its jobs cleanly (each keeps its last checkpoint); relaunch to resume.

``--launcher local`` (default) runs ``--jobs N`` at a time, or one per GPU with
``--gpus 0,1,...`` (each job sees its GPU as ``CUDA_VISIBLE_DEVICES``), and prints
each start and end as ``[n/N]`` with the job and the ETA. ``--launcher slurm`` submits
one SLURM array task per job through submitit (``--partition``, ``--gpus_per_job``,
``--time_min``, ...): on preemption or at the time limit the task stops its run and
submitit requeues it, and the requeued task resumes from the checkpoint.
``--launcher submitit_local`` is the same path on this machine (submitit's local
executor; the tests use it). A job's output goes to ``out.txt`` / ``err.txt`` in its
directory (appended, one header per launch); a failing job does not stop the
others and is reported at the end (exit status 1).

Test environments: ``all`` (each environment alone), ``all_with_pairs`` (each
alone and every pair, as DomainBed's sweep; leave-one-domain-out selection needs
the pairs), or explicit sets such as ``0 1 0,1``. ``--set`` and ``--grid`` may be
repeated; each adds keys.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import datetime
import hashlib
import itertools
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from sagm_jax import claims  # noqa: E402
from sagm_jax.data import registry  # noqa: E402
from sagm_jax.optimizers import ALGORITHMS  # noqa: E402

# The datasets a sweep can run: those of the registry with a config file and a known
# number of environments (an ImageFolder's depends on its data_dir).
CONFIG_FILES = {
    name: spec.config_file
    for name, spec in registry.DATASETS.items()
    if spec.config_file and spec.domains
}
DATASET_OF = {path: name for name, path in CONFIG_FILES.items()}

# The paper's search space for the other methods (docs/protocol.md); "paper" keeps each
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
# ``alpha`` is SAGM's alone (erm_sam is SAGM with alpha 0); GSAM has ``gsam_alpha``.
USED_BY = {
    "alpha": ("sagm",),
    "gsam_alpha": ("gsam",),
    "rho": ("sam", "gsam", "sagm", "erm_sam"),
    "combine": ("sagm", "erm_sam"),
}
# What every job's arguments hold besides its grid point and --set keys.
SWEEP_KEYS = ("config", "algorithm", "test_envs", "trial_seed", "seed")

DONE, RUNNING, INCOMPLETE, NOT_LAUNCHED = "done", "running", "incomplete", "not launched"
CLAIM = "launcher.lock"  # held by the launcher that runs the job, and by the job's process
RUN_LOCK = "run.lock"  # held by sagm_jax.main while it trains the directory
# Outcomes of run_job other than an exit status.
ELSEWHERE, ALREADY_DONE, STOPPED = "running elsewhere", "done already", "stopped"
INTERRUPTED_EXIT = 130  # sagm_jax.main after Ctrl-C / SIGTERM
STOP_GRACE_S = 120  # a stopped run's time to finish its checkpoint save


def num_environments(dataset: str) -> int:
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

    def is_done(self) -> bool:
        return os.path.exists(os.path.join(self.directory, "done"))

    def status(self) -> str:
        if self.is_done():
            return DONE
        if claims.is_claimed(self.directory, CLAIM) or claims.is_claimed(self.directory, RUN_LOCK):
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
        return " ".join(words + [f"{k}={render(args[k])}" for k in extra_keys if k in args])


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


def varying_keys(jobs: list[Job]) -> list[str]:
    """The grid keys whose values differ between the jobs (what tells them apart besides
    dataset, algorithm, test environments and trial seed)."""
    keys = sorted({k for job in jobs for k in job.args} - set(SWEEP_KEYS))
    return [k for k in keys if len({json.dumps(job.args.get(k)) for job in jobs}) > 1]


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{s:02d}s"


def run_job(job: Job, command: list[str], gpu: str | None = None, started=None):
    """Claims ``job``, runs ``command`` in its directory with the claim handed to the
    process, and returns the exit status; ELSEWHERE when another process holds the
    claim, ALREADY_DONE when the job finished meanwhile. ``started(process)`` is called
    once the process runs."""
    claim = claims.try_claim(job.directory, CLAIM)
    if claim is None:
        return ELSEWHERE
    with claim:
        if job.is_done():  # finished by another launcher since this one looked
            return ALREADY_DONE
        with open(os.path.join(job.directory, "args.json"), "w") as f:
            json.dump(job.args, f, indent=2, sort_keys=True)
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        # Appended, never truncated: a job's history of launches stays readable.
        with (
            open(os.path.join(job.directory, "out.txt"), "a") as out,
            open(os.path.join(job.directory, "err.txt"), "a") as err,
        ):
            header = (
                f"=== {datetime.datetime.now().isoformat(timespec='seconds')} on "
                f"{socket.gethostname()} (launcher pid {os.getpid()}): {shlex.join(command)}\n"
            )
            for f in (out, err):
                f.write(header)
                f.flush()
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                cwd=REPO,
                env=env,
                pass_fds=(claim.fileno(),),  # the job keeps the claim if the launcher dies
                start_new_session=True,  # signals reach it through the launcher only
            )
            if started is not None:
                started(process)
            # Polling, not wait(): a signal handler of this thread may wait for it too.
            while process.poll() is None:
                time.sleep(0.2)
            return process.returncode


def stop_process(process, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (sagm_jax.main stops as after Ctrl-C, keeping its checkpoint), then
    SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if process.poll() is None:
        process.kill()


class Progress:
    """``[n/N]`` lines for starts and ends, with the job and the ETA."""

    def __init__(self, total: int, workers: int, extra_keys, log):
        self.total, self.workers, self.extra_keys, self.log = total, workers, extra_keys, log
        self.count, self.ended, self.durations = 0, 0, []
        self.lock = threading.Lock()

    def start(self, job: Job) -> tuple[int, float]:
        with self.lock:
            self.count += 1
            n = self.count
        width = len(str(self.total))
        self.log(f"[{n:>{width}}/{self.total}] start   {job.describe(self.extra_keys)}")
        return n, time.monotonic()

    def skip(self) -> None:
        """A job that turned out done or claimed elsewhere: not one of the N."""
        with self.lock:
            self.total -= 1

    def end(self, n: int, start: float, job: Job, outcome) -> None:
        seconds = time.monotonic() - start
        with self.lock:
            self.ended += 1
            if outcome == 0:
                self.durations.append(seconds)
            left = self.total - self.ended
        if outcome == 0:
            word = "done   "
        elif outcome == INTERRUPTED_EXIT:
            word = "stopped"
        else:
            word = f"FAILED (exit {outcome}, see {os.path.join(job.directory, 'err.txt')})"
        eta = (
            f"ETA {_duration(sum(self.durations) / len(self.durations) * left / self.workers)}"
            if self.durations and left
            else ""
        )
        width = len(str(self.total))
        tail = f"; {left} left" + (f", {eta}" if eta else "") if left else ""
        self.log(
            f"[{n:>{width}}/{self.total}] {word} {job.describe(self.extra_keys)} in "
            f"{_duration(seconds)}{tail}"
        )


def launch(
    jobs: list[Job],
    workers: int = 1,
    gpus: list[str] | None = None,
    make_command=Job.command,
    log=print,
) -> dict:
    """Runs every job that is not done and not claimed elsewhere. Returns ``{"skipped":
    [...], "finished": [...], "failed": [(job, exit status), ...], "elsewhere": [...],
    "stopped": [...]}`` ("stopped": interrupted by Ctrl-C / SIGTERM, or never started
    because of it)."""
    result = {"skipped": [], "finished": [], "failed": [], "elsewhere": [], "stopped": []}
    todo = []
    for job in jobs:
        status = job.status()
        if status == DONE:
            result["skipped"].append(job)
        elif status == RUNNING:
            result["elsewhere"].append(job)
        else:
            todo.append(job)
    n_workers = len(gpus) if gpus else max(1, workers)
    log(
        f"{len(jobs)} jobs: {len(result['skipped'])} done, {len(result['elsewhere'])} "
        f"running elsewhere, {len(todo)} to run ({n_workers} at a time)."
    )
    free_gpus = queue.Queue()
    for gpu in gpus or []:
        free_gpus.put(gpu)
    progress = Progress(len(todo), n_workers, varying_keys(jobs), log)
    stop, running = threading.Event(), set()

    def work(job):
        if stop.is_set():
            return STOPPED
        gpu = free_gpus.get() if gpus else None
        state = {}

        def started(process):
            running.add(process)
            state["n"], state["start"] = progress.start(job)
            if stop.is_set():  # a signal arrived while it started
                process.send_signal(signal.SIGTERM)

        try:
            outcome = STOPPED if stop.is_set() else run_job(job, make_command(job), gpu, started)
        finally:
            if gpus:
                free_gpus.put(gpu)
            running.difference_update({p for p in list(running) if p.poll() is not None})
        if "n" in state:
            progress.end(state["n"], state["start"], job, outcome)
        else:
            progress.skip()
        return outcome

    def on_signal(signum, frame):
        if not stop.is_set():
            log(
                f"Stopping ({signal.Signals(signum).name}): the running jobs save and stop; "
                "relaunch the same command to resume them."
            )
        stop.set()
        for process in list(running):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handlers[signum] = signal.signal(signum, on_signal)
    try:
        with concurrent.futures.ThreadPoolExecutor(n_workers) as pool:
            futures = {pool.submit(work, job): job for job in todo}
            for future in concurrent.futures.as_completed(futures):
                job = futures[future]
                try:
                    outcome = future.result()
                except OSError as error:  # the command could not start
                    outcome = f"{type(error).__name__}: {error}"
                    log(f"FAILED to start {job.describe()}: {outcome}")
                if outcome == 0:
                    result["finished"].append(job)
                elif outcome == ALREADY_DONE:
                    result["skipped"].append(job)
                elif outcome == ELSEWHERE:
                    result["elsewhere"].append(job)
                    log(f"running elsewhere (claimed by another launcher): {job.describe()}")
                elif outcome == STOPPED or (stop.is_set() and outcome == INTERRUPTED_EXIT):
                    result["stopped"].append(job)
                else:
                    result["failed"].append((job, outcome))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return result


class ClusterTask:
    """One job as a submitit task (a SLURM array task; a local process with
    ``cluster="local"``): claims the job and runs its command as :func:`run_job` does.
    On preemption or at the time limit submitit calls :meth:`checkpoint`, which stops
    the run cleanly (it keeps its checkpoint) and has submitit requeue this task; the
    requeued task runs the same command, which resumes."""

    def __init__(self, args: dict, output_dir: str, command: list[str]):
        self.args, self.output_dir, self.command = args, output_dir, command
        self._process = None

    def __call__(self):
        def started(process):
            self._process = process

        outcome = run_job(Job(self.args, self.output_dir), self.command, None, started)
        return {"job": job_hash(self.args), "outcome": outcome}

    def checkpoint(self, *args, **kwargs):
        from submitit.helpers import DelayedSubmission

        if self._process is not None:
            stop_process(self._process)
        return DelayedSubmission(self, *args, **kwargs)

    def __getstate__(self):
        return {**self.__dict__, "_process": None}


def make_executor(
    output_dir: str,
    cluster: str = "slurm",
    *,
    partition: str | None = None,
    account: str | None = None,
    gpus_per_job: int = 1,
    cpus_per_job: int | None = None,
    mem_gb: int | None = None,
    time_min: int = 240,
    array_parallelism: int = 256,
    signal_delay_s: int = 120,
):
    """A submitit executor for ``cluster`` ("slurm", or "local": submitit's local
    executor), logging to ``<output_dir>/.submitit/<job id>``. ``signal_delay_s``: how
    long before the time limit a task is told to stop and requeue."""
    import submitit

    executor = submitit.AutoExecutor(
        folder=os.path.join(output_dir, ".submitit", "%j"), cluster=cluster
    )
    parameters = {
        "name": "sagm_sweep",
        "timeout_min": time_min,
        "gpus_per_node": gpus_per_job,
        "cpus_per_task": cpus_per_job,
        "mem_gb": mem_gb,
        "slurm_partition": partition,
        "slurm_account": account,
        "slurm_array_parallelism": array_parallelism,
        "slurm_signal_delay_s": signal_delay_s,
        # The task process unpickles ClusterTask from this repository, wherever it starts.
        "slurm_setup": [PYTHONPATH_SETUP],
        "local_setup": [PYTHONPATH_SETUP],
    }
    executor.update_parameters(**{k: v for k, v in parameters.items() if v is not None})
    return executor


PYTHONPATH_SETUP = f"export PYTHONPATH={shlex.quote(REPO)}${{PYTHONPATH:+:$PYTHONPATH}}"


def submit(jobs: list[Job], output_dir: str, executor, make_command=Job.command, log=print):
    """Submits every job that is neither done nor running as ONE submitit job array
    (with SLURM: one array task per job) of :class:`ClusterTask`; returns the submitit
    jobs."""
    todo = [job for job in jobs if job.status() not in (DONE, RUNNING)]
    log(f"{len(jobs)} jobs: {len(jobs) - len(todo)} done or running; submitting {len(todo)}.")
    if not todo:
        return []
    with executor.batch():
        submitted = [
            executor.submit(ClusterTask(job.args, output_dir, make_command(job))) for job in todo
        ]
    keys = varying_keys(jobs)
    for job, task in zip(todo, submitted):
        log(f"submitted {task.job_id}: {job.describe(keys)}")
    return submitted


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
    values = collections_of_values(jobs)
    lines = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if name.startswith(".") or name in known or not os.path.isdir(path):
            continue
        args_path = os.path.join(path, "args.json")
        if not os.path.exists(args_path):
            lines.append(f"{name[:10]}  not a job folder (no args.json)")
            continue
        with open(args_path) as f:
            args = json.load(f)
        differences = []
        for key in sorted(set(args) | set(values)):
            value = json.dumps(args.get(key))
            if value not in values.get(key, {json.dumps(None)}):
                grid = ", ".join(sorted(values.get(key, {"unset"})))
                differences.append(f"{key}={value if key in args else 'unset'} (this grid: {grid})")
        status = Job(args, output_dir).status()
        why = "; ".join(differences) or "arguments match, but not its folder name"
        lines.append(f"{name[:10]}  {status:<12}  {why}")
    return lines


def collections_of_values(jobs: list[Job]) -> dict[str, set[str]]:
    """``{key: {JSON of each value the grid's jobs give it}}``."""
    values = {}
    for job in jobs:
        for key, value in job.args.items():
            values.setdefault(key, set()).add(json.dumps(value))
    return values


def delete_incomplete(jobs: list[Job]) -> list[Job]:
    deleted = [job for job in jobs if job.status() == INCOMPLETE]
    for job in deleted:
        shutil.rmtree(job.directory)
    return deleted


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=V1,V2",
        help="More swept values (override the preset's for that key); repeatable.",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="Config overrides for every job (part of the job's hash); repeatable, each "
        "--set adds its keys.",
    )
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dry_run", action="store_true", help="List the commands; run nothing.")
    parser.add_argument("--yes", action="store_true", help="delete_incomplete without asking.")
    parser.add_argument(
        "--launcher",
        choices=["local", "slurm", "submitit_local"],
        default="local",
        help="local processes; SLURM array tasks through submitit; or submitit's local "
        "executor (the SLURM path on this machine).",
    )
    local = parser.add_argument_group("--launcher local")
    local.add_argument("--jobs", type=int, default=1, help="Jobs at a time (without --gpus).")
    local.add_argument("--gpus", help="Comma-separated GPU ids: one worker per GPU.")
    cluster = parser.add_argument_group("--launcher slurm / submitit_local")
    cluster.add_argument("--partition", help="SLURM partition.")
    cluster.add_argument("--account", help="SLURM account.")
    cluster.add_argument("--gpus_per_job", type=int, default=1, help="GPUs per job (one node).")
    cluster.add_argument("--cpus_per_job", type=int, help="CPU cores per job (input pipeline).")
    cluster.add_argument("--mem_gb", type=int, help="Host memory per job.")
    cluster.add_argument(
        "--time_min", type=int, default=240, help="Time limit per job; it requeues when hit."
    )
    cluster.add_argument("--array_parallelism", type=int, default=256, help="Jobs at a time.")
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
        unknown = unknown_folders(jobs, args.output_dir)
        if unknown:
            print(
                f"\n{len(unknown)} folder(s) in {args.output_dir} are not jobs of this grid "
                "(launched with other arguments; what differs):"
            )
            print("\n".join("  " + line for line in unknown))
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
    elif args.launcher != "local":
        try:
            executor = make_executor(
                args.output_dir,
                "slurm" if args.launcher == "slurm" else "local",
                partition=args.partition,
                account=args.account,
                gpus_per_job=args.gpus_per_job,
                cpus_per_job=args.cpus_per_job,
                mem_gb=args.mem_gb,
                time_min=args.time_min,
                array_parallelism=args.array_parallelism,
            )
        except RuntimeError as error:  # submitit finds no srun: not a SLURM machine
            print(f"sweep: --launcher {args.launcher}: {error}", file=sys.stderr)
            return 2
        submitted = submit(jobs, args.output_dir, executor)
        if submitted:
            print(
                f"Submitted {len(submitted)} jobs; logs in {args.output_dir}/.submitit/. "
                "`status` with the same arguments shows their progress."
            )
        if args.launcher == "submitit_local":
            outcomes = [task.result()["outcome"] for task in submitted]
            return 0 if all(o in (0, ALREADY_DONE, ELSEWHERE) for o in outcomes) else 1
    else:
        gpus = args.gpus.split(",") if args.gpus else None
        result = launch(jobs, workers=args.jobs, gpus=gpus)
        print(
            f"Summary: {len(result['finished'])} finished, {len(result['skipped'])} skipped "
            f"(done), {len(result['elsewhere'])} running elsewhere, {len(result['stopped'])} "
            f"stopped, {len(result['failed'])} failed."
        )
        for job, code in result["failed"]:
            print(f"  failed ({code}): {job.directory}")
        if result["stopped"]:
            print("Relaunch the same command to resume the stopped jobs.")
            return INTERRUPTED_EXIT
        return 1 if result["failed"] else 0
    return 0


if __name__ == "__main__":
    # Run as the module experiments.sweep, so that submitit pickles ClusterTask by
    # reference to an importable module.
    from experiments import sweep

    sys.exit(sweep.main())
