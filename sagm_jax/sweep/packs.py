"""The sweep's packs: jobs that share a program, trained up to R at a time in one process.

``launch --pack R`` groups the jobs by their program (``sagm_jax.training.packed``:
everything but the seeds, the split, the test environments and the continuous
hyperparameters) and cuts each group, in the grid's order, into packs of at most R.
The grouping reads every job of the grid, done or not, so a relaunch forms the same
packs: a pack whose runs are partly done keeps its finished runs as lanes that only
hold their place (their state is never read or written), and its other runs resume
in the program they started in, bit for bit. A job that cannot be packed
(``packed.program_problems``: per-device perturbation) is a pack of one, run as
``python -m sagm_jax.main``.

A pack is described by ``<output_dir>/packs/<id>/pack.json`` (the jobs' arguments in
lane order); ``python -m sagm_jax.sweep.packs PACK_JSON --train 0,2`` trains it, the
lanes listed being those its launcher claimed (``sagm_jax.sweep.launchers``: it holds
each of their ``launcher.lock`` and hands the claims over). The process claims each of
those runs' ``run.lock`` as ``sagm_jax.main`` does; its output goes to the pack's
``out.txt`` / ``err.txt``, and each job's ``out.txt`` says which pack trained it. Each
job's directory is exactly a run's: ``status``, ``collect_results``, ``load_run`` and
``delete_incomplete`` read it as any, and the job relaunched alone (without
``--pack``) resumes from its own checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

from sagm_jax.sweep.jobs import DONE, INCOMPLETE, NOT_LAUNCHED, PACKS, RUNNING, Job, job_hash

PACK_FILE = "pack.json"


class Pack:
    """Jobs trained as one program: the launchers treat it as a job (``status``,
    ``describe``, ``is_done``) whose claims are its jobs' claims."""

    def __init__(self, jobs: list[Job], output_dir: str):
        self.jobs = list(jobs)
        self.output_dir = os.path.abspath(output_dir)
        digest = hashlib.md5(" ".join(job_hash(j.args) for j in self.jobs).encode()).hexdigest()
        self.directory = os.path.join(self.output_dir, PACKS, digest)

    def status(self) -> str:
        statuses = {job.status() for job in self.jobs}
        if statuses == {DONE}:
            return DONE
        if statuses <= {DONE, RUNNING}:
            return RUNNING
        return NOT_LAUNCHED if statuses == {NOT_LAUNCHED} else INCOMPLETE

    def is_done(self) -> bool:
        return all(job.is_done() for job in self.jobs)

    def describe(self, extra_keys=()) -> str:
        first = self.jobs[0].describe(extra_keys)
        return f"pack of {len(self.jobs)}: {first}" + (" ..." if len(self.jobs) > 1 else "")

    def write(self) -> str:
        """Writes ``pack.json`` (the lanes' arguments); returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, PACK_FILE)
        with open(path, "w") as f:
            json.dump({"jobs": [job.args for job in self.jobs]}, f, indent=1, sort_keys=True)
        return path

    def command(self, lanes: list[int]) -> list[str]:
        """The process that trains ``lanes`` (those claimed) of this pack."""
        return [
            sys.executable, "-m", "sagm_jax.sweep.packs",
            os.path.join(self.directory, PACK_FILE),
            "--train", ",".join(str(lane) for lane in lanes),
        ]


def program_of(config_dict: dict) -> str | None:
    """The key of the program the job's config runs; None for a job that is not packed."""
    from sagm_jax.training import packed

    if packed.program_problems([config_dict]):
        return None
    return packed.program_key(config_dict)


def make_packs(jobs: list[Job], output_dir: str, size: int) -> list[Job | Pack]:
    """The jobs grouped by program, in their order, cut into packs of at most ``size``;
    a job alone in its program, or that cannot be packed, stays a :class:`Job`."""
    from sagm_jax.sweep import preflight

    builder, groups = preflight.Builder(), {}
    for job in jobs:
        config, _ = builder.config(job)
        key = program_of(config.to_dict()) if config is not None else None
        groups.setdefault(key if key is not None else ("alone", job_hash(job.args)), []).append(job)
    items = []
    for group in groups.values():
        for start in range(0, len(group), size):
            chunk = group[start:start + size]
            items.append(chunk[0] if len(chunk) == 1 else Pack(chunk, output_dir))
    return items


def grouping_lines(items: list[Job | Pack]) -> list[str]:
    """How :func:`make_packs` grouped the jobs: one line per program with its packs'
    sizes, named by the arguments that set it apart from the other programs."""
    from sagm_jax.training import packed

    per_run = set(packed.RUN_KEYS) | set(packed.traced_keys())
    programs = {}
    for item in items:
        jobs = item.jobs if isinstance(item, Pack) else [item]
        shared = {k: v for k, v in jobs[0].args.items() if k not in per_run}
        programs.setdefault(json.dumps(shared, sort_keys=True), []).append(len(jobs))
    shared_args = [json.loads(key) for key in programs]
    apart = sorted(
        key for key in set().union(*shared_args)
        if len({json.dumps(args.get(key)) for args in shared_args}) > 1
    )
    lines = []
    for args, sizes in zip(shared_args, programs.values()):
        label = " ".join(f"{key}={args.get(key)}" for key in apart) or "one program"
        lines.append(f"  {label}: {sum(sizes)} jobs in {len(sizes)} process(es) of "
                     f"{', '.join(map(str, sizes))} run(s)")
    return lines


def _configs(pack_file: str) -> tuple[list, list[str]]:
    """The lanes' configs and run directories, from ``pack.json``."""
    from sagm_jax.sweep import preflight

    output_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(pack_file))))
    with open(pack_file) as f:
        lanes = json.load(f)["jobs"]
    builder, configs, workdirs = preflight.Builder(), [], []
    for args in lanes:
        job = Job(args, output_dir)
        config, problems = builder.config(job)
        if config is None or problems:
            raise ValueError(f"{pack_file}: job {job.directory}: {problems}")
        configs.append(config.copy_and_resolve_references())
        workdirs.append(job.directory)
    return configs, workdirs


def main(argv=None) -> int:
    """``python -m sagm_jax.sweep.packs PACK_JSON --train LANES``."""
    parser = argparse.ArgumentParser(prog="python -m sagm_jax.sweep.packs")
    parser.add_argument("pack", help="A pack's pack.json.")
    parser.add_argument("--train", required=True, help="Comma-separated lanes to train.")
    args = parser.parse_args(argv)
    started = time.monotonic()
    from sagm_jax import cli, claims, cpu

    cpu.configure()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    cli.quiet_tensorflow_import()
    try:
        from sagm_jax.data import tf_input
        tf_input.hide_accelerators_from_tensorflow()
    except ImportError:
        pass
    from sagm_jax.training import packed
    from sagm_jax.training.rundir import RUN_LOCK

    configs, workdirs = _configs(args.pack)
    train = {int(lane) for lane in args.train.split(",") if lane}
    held = []
    for lane in sorted(train):
        claim = claims.try_claim(workdirs[lane], RUN_LOCK)
        if claim is None:  # another process trains it: this pack leaves its lane alone
            print(f"{workdirs[lane]}: another process is training it; not trained here.")
            train.discard(lane)
        else:
            held.append(claim)
    imported = time.monotonic()
    try:
        packed.train_pack(configs, workdirs, train=train)
        print(f"pack process (s): {time.monotonic() - started:.2f} in all, "
              f"{imported - started:.2f} importing and reading the configs")
    except KeyboardInterrupt:
        print("Stopped; every run keeps its last checkpoint. Relaunch the sweep to resume.",
              file=sys.stderr)
        return cli.INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
