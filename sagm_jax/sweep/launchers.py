"""The sweep's launchers: each job run exactly once, on this machine or through SLURM.

Exactly once: a launcher CLAIMS a job before it touches the job's directory
(``sagm_jax.claims``: a lock on ``launcher.lock`` that the kernel drops when its
holder dies) and hands the claim to the job's process. Any number of launchers, on
one machine or on several sharing the file system, therefore run each job once; a
job whose launcher and process have died is claimed again by the next launcher and
resumes from its checkpoint. A launcher that is killed outright (SIGKILL, a lost
terminal) leaves its jobs running with their claims: they finish, and meanwhile
every other launcher reports them as running. Ctrl-C or SIGTERM stops the launcher
AND its jobs cleanly (each keeps its last checkpoint); relaunch to resume.

:func:`launch` runs local processes, ``workers`` at a time or one per GPU (each job
sees its GPU as ``CUDA_VISIBLE_DEVICES``), and prints each start and end as ``[n/N]``
with the job and the ETA. :func:`submit` hands the jobs to a submitit executor as one
job array of :class:`ClusterTask` (SLURM array tasks, or submitit's local executor):
on preemption or at the time limit a task stops its run and submitit requeues it,
and the requeued task resumes from the checkpoint. The task is pickled by reference
to this module, which every process that has the package installed imports.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import threading
import time

from sagm_jax import claims
from sagm_jax.cli import REPO
from sagm_jax.formatting import duration
from sagm_jax.sweep.packs import Pack
from sagm_jax.sweep.jobs import (
    ARGS,
    CLAIM,
    DONE,
    ERR,
    OUT,
    RUNNING,
    SWEEP_KEYS,
    Job,
    job_hash,
    varying_keys,
)

# Outcomes of run_job other than an exit status.
ELSEWHERE, ALREADY_DONE, STOPPED = "running elsewhere", "done already", "stopped"
INTERRUPTED_EXIT = 130  # sagm_jax.main after Ctrl-C / SIGTERM
STOP_GRACE_S = 120  # a stopped run's time to finish its checkpoint save


def run_job(job: Job | Pack, command: list[str] | None, gpu: str | None = None, started=None):
    """Claims ``job``, runs ``command`` in its directory with the claim handed to the
    process, and returns the exit status; ELSEWHERE when another process holds the
    claim, ALREADY_DONE when the job finished meanwhile. ``started(process)`` is called
    once the process runs. A :class:`Pack` (``command`` None) goes to :func:`run_pack`."""
    if isinstance(job, Pack):
        return run_pack(job, gpu, started)
    claim = claims.try_claim(job.directory, CLAIM)
    if claim is None:  # a job that finished still holds it while its process exits
        return ALREADY_DONE if job.is_done() else ELSEWHERE
    with claim:
        if job.is_done():  # finished by another launcher since this one looked
            return ALREADY_DONE
        _write_args(job)
        return _run_process(command, job.directory, [claim], gpu, started)


def run_pack(pack: Pack, gpu: str | None = None, started=None):
    """Claims what it can of ``pack``'s jobs that are not done and runs the pack's
    process for them (``sagm_jax.sweep.packs``), the claims handed to it; its output in
    the pack's folder, a line in each job's ``out.txt`` saying so. ELSEWHERE / ALREADY_DONE
    when it claimed none."""
    held, lanes = [], []
    try:
        for lane, job in enumerate(pack.jobs):
            if job.is_done():
                continue
            claim = claims.try_claim(job.directory, CLAIM)
            if claim is None:
                continue
            if job.is_done():
                claim.release()
                continue
            held.append(claim)
            lanes.append(lane)
        if not lanes:
            return ALREADY_DONE if pack.is_done() else ELSEWHERE
        pack.write()
        command = pack.command(lanes)
        for lane in lanes:
            job = pack.jobs[lane]
            _write_args(job)
            with open(os.path.join(job.directory, OUT), "a") as out:
                out.write(f"{_header(command)}trained in a pack of {len(pack.jobs)} (lane "
                          f"{lane}); its output: {os.path.join(pack.directory, OUT)}\n")
        return _run_process(command, pack.directory, held, gpu, started)
    finally:
        for claim in held:
            claim.release()


def _write_args(job: Job) -> None:
    with open(os.path.join(job.directory, ARGS), "w") as f:
        json.dump(job.args, f, indent=2, sort_keys=True)


def _header(command: list[str]) -> str:
    return (
        f"=== {datetime.datetime.now().isoformat(timespec='seconds')} on "
        f"{socket.gethostname()} (launcher pid {os.getpid()}): {shlex.join(command)}\n"
    )


def _run_process(command, directory: str, held: list, gpu, started) -> int:
    """Runs ``command`` with its output appended to ``directory``'s out.txt / err.txt
    and the claims ``held`` handed to it; returns its exit status."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    # Appended, never truncated: a job's history of launches stays readable.
    with (
        open(os.path.join(directory, OUT), "a") as out,
        open(os.path.join(directory, ERR), "a") as err,
    ):
        for f in (out, err):
            f.write(_header(command))
            f.flush()
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=err,
            cwd=REPO,  # the jobs' config files are relative to the repository
            env=env,
            # The job keeps its claims if the launcher dies.
            pass_fds=tuple(claim.fileno() for claim in held),
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
        """A job that turned out done or claimed elsewhere: no longer left to run. The
        N stays the count of jobs to run at launch, so every line has the same N."""
        with self.lock:
            self.ended += 1

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
            word = f"FAILED (exit {outcome}, see {os.path.join(job.directory, ERR)})"
        eta = (
            f"ETA {duration(sum(self.durations) / len(self.durations) * left / self.workers)}"
            if self.durations and left
            else ""
        )
        width = len(str(self.total))
        tail = f"; {left} left" + (f", {eta}" if eta else "") if left else ""
        self.log(
            f"[{n:>{width}}/{self.total}] {word} {job.describe(self.extra_keys)} in "
            f"{duration(seconds)}{tail}"
        )


def launch(
    jobs: list[Job],
    workers: int = 1,
    gpus: list[str] | None = None,
    make_command=Job.command,
    log=print,
) -> dict:
    """Runs every job (or :class:`Pack` of jobs, ``sagm_jax.sweep.packs``) that is not
    done and not claimed elsewhere. Returns ``{"skipped": [...], "finished": [...],
    "failed": [(job, exit status), ...], "elsewhere": [...], "stopped": [...]}`` of the
    jobs, a pack's jobs where the pack went ("stopped": interrupted by Ctrl-C / SIGTERM,
    or never started because of it)."""
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
    done_before = {id(job) for job in _all_jobs(jobs) if job.is_done()}
    elsewhere = len(_all_jobs(result["elsewhere"]))
    packs = f" in {len(todo)} packs" if any(isinstance(i, Pack) for i in todo) else ""
    log(
        f"{len(_all_jobs(jobs))} jobs: {len(done_before)} done, {elsewhere} running "
        f"elsewhere, {len(_all_jobs(todo)) - len(done_before & {id(j) for j in _all_jobs(todo)})}"
        f" to run{packs} ({n_workers} at a time)."
    )
    progress = Progress(
        len(todo), n_workers, varying_keys(_all_jobs(jobs), exclude=SWEEP_KEYS), log
    )
    workers = _Workers(gpus, make_command, progress)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handlers[signum] = signal.signal(signum, workers.on_signal)
    try:
        with concurrent.futures.ThreadPoolExecutor(n_workers) as pool:
            futures = {pool.submit(workers.work, job): job for job in todo}
            for future in concurrent.futures.as_completed(futures):
                job = futures[future]
                try:
                    outcome = future.result()
                except OSError as error:  # the command could not start
                    outcome = f"{type(error).__name__}: {error}"
                    log(f"FAILED to start {job.describe()}: {outcome}")
                _file_outcome(result, job, outcome, workers.stop.is_set(), log)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    # A job another launcher ran may have finished meanwhile: done, not running.
    finished_elsewhere = [job for job in result["elsewhere"] if job.is_done()]
    result["skipped"] += finished_elsewhere
    result["elsewhere"] = [job for job in result["elsewhere"] if job not in finished_elsewhere]
    # Per job: a pack's jobs go where the pack went, but those done before it started.
    jobs_result = {name: [] for name in result}
    for name, items in result.items():
        for item in items:
            item, code = item if name == "failed" else (item, None)
            for job in _jobs_of(item):
                if id(job) in done_before:
                    jobs_result["skipped"].append(job)
                else:
                    jobs_result[name].append((job, code) if name == "failed" else job)
    return jobs_result


def _jobs_of(item) -> list[Job]:
    return item.jobs if isinstance(item, Pack) else [item]


def _all_jobs(items) -> list[Job]:
    return [job for item in items for job in _jobs_of(item)]


def _file_outcome(result: dict, job: Job, outcome, stopping: bool, log) -> None:
    """Adds ``job`` to the list of :func:`launch`'s result that ``outcome`` names."""
    if outcome == 0:
        result["finished"].append(job)
    elif outcome == ALREADY_DONE:
        result["skipped"].append(job)
    elif outcome == ELSEWHERE:
        result["elsewhere"].append(job)
        log(f"running elsewhere (claimed by another launcher): {job.describe()}")
    elif outcome == STOPPED or (stopping and outcome == INTERRUPTED_EXIT):
        result["stopped"].append(job)
    else:
        result["failed"].append((job, outcome))


class _Workers:
    """What :func:`launch`'s worker threads share: the free GPUs, the running
    processes, the progress lines, and the stop that a signal sets."""

    def __init__(self, gpus, make_command, progress: Progress):
        self.gpus, self.make_command, self.progress = gpus, make_command, progress
        self.free_gpus = queue.Queue()
        for gpu in gpus or []:
            self.free_gpus.put(gpu)
        self.stop, self.running = threading.Event(), set()

    def work(self, job: Job):
        """Runs ``job`` on a free GPU (or none); returns its outcome."""
        if self.stop.is_set():
            return STOPPED
        gpu = self.free_gpus.get() if self.gpus else None
        state = {}

        def started(process):
            self.running.add(process)
            state["n"], state["start"] = self.progress.start(job)
            if self.stop.is_set():  # a signal arrived while it started
                process.send_signal(signal.SIGTERM)

        try:
            command = None if isinstance(job, Pack) else self.make_command(job)
            outcome = STOPPED if self.stop.is_set() else run_job(job, command, gpu, started)
        finally:
            if self.gpus:
                self.free_gpus.put(gpu)
            self.running.difference_update({p for p in list(self.running) if p.poll() is not None})
        if "n" in state:
            self.progress.end(state["n"], state["start"], job, outcome)
        else:
            self.progress.skip()
        return outcome

    def on_signal(self, signum, frame):
        if not self.stop.is_set():
            self.progress.log(
                f"Stopping ({signal.Signals(signum).name}): the running jobs save and stop; "
                "relaunch the same command to resume them."
            )
        self.stop.set()
        for process in list(self.running):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)


class ClusterTask:
    """One job as a submitit task (a SLURM array task; a local process with
    ``cluster="local"``): claims the job and runs its command as :func:`run_job` does.
    On preemption or at the time limit submitit calls :meth:`checkpoint`, which stops
    the run cleanly (it keeps its checkpoint) and has submitit requeue this task; the
    requeued task runs the same command, which resumes."""

    def __init__(self, args: dict | list[dict], output_dir: str, command: list[str] | None):
        # ``args``: a job's arguments, or the list of a pack's (``command`` None).
        self.args, self.output_dir, self.command = args, output_dir, command
        self._process = None

    def __call__(self):
        def started(process):
            self._process = process

        if isinstance(self.args, list):
            item = Pack([Job(args, self.output_dir) for args in self.args], self.output_dir)
            name = os.path.basename(item.directory)
        else:
            item, name = Job(self.args, self.output_dir), job_hash(self.args)
        outcome = run_job(item, self.command, None, started)
        return {"job": name, "outcome": outcome}

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
    }
    executor.update_parameters(**{k: v for k, v in parameters.items() if v is not None})
    return executor


def submit(jobs: list[Job], output_dir: str, executor, make_command=Job.command, log=print):
    """Submits every job (or :class:`Pack`) that is neither done nor running as ONE
    submitit job array (with SLURM: one array task per job or pack) of
    :class:`ClusterTask`; returns the submitit jobs."""
    todo = [job for job in jobs if job.status() not in (DONE, RUNNING)]
    log(f"{len(jobs)} jobs: {len(jobs) - len(todo)} done or running; submitting {len(todo)}.")
    if not todo:
        return []

    def task(item):
        if isinstance(item, Pack):
            return ClusterTask([job.args for job in item.jobs], output_dir, None)
        return ClusterTask(item.args, output_dir, make_command(item))

    with executor.batch():
        submitted = [executor.submit(task(item)) for item in todo]
    keys = varying_keys(_all_jobs(jobs), exclude=SWEEP_KEYS)
    for job, task in zip(todo, submitted):
        log(f"submitted {task.job_id}: {job.describe(keys)}")
    return submitted


