"""The sweep's command line: a grid of ``python -m sagm_jax.main`` jobs, run exactly once each.

    python -m sagm_jax.sweep launch --datasets RotatedDigits \\
        --algorithms erm sam gsam sagm --test_envs all --trial_seeds 0 1 2 \\
        [--objectives erm coral] [--disam_lambdas 0 0.1] \\
        --output_dir sweeps/digits --jobs 2 [--hparams paper|reduced|swad] \\
        [--hparams random --n_hparams 20] \\
        [--grid lr=1e-5,3e-5] [--set steps=301 --set eval_every=50 ...] [--gpus 0,1] [--dry_run]
    python -m sagm_jax.sweep launch ...same grid... --launcher slurm --partition gpu \\
        --gpus_per_job 1 --time_min 240 [--account A] [--array_parallelism 64]
    python -m sagm_jax.sweep status ...same grid arguments...
    python -m sagm_jax.sweep delete_incomplete ...same grid arguments... [--yes]

The grid (``sagm_jax.sweep.jobs``): each dataset's config file, every method (update
rule x objective x DISAM lambda of ``sagm_jax.methods``, less the combinations it
refuses, each skipped with one line saying why), test environment set, trial seed and
point of ``--hparams`` / ``--grid`` (a method's own hyperparameters only for it), with
every ``--set``. ``--hparams`` presets are per dataset
(``sagm_jax.sweep.jobs.preset_grid``); ``--hparams random`` gives each job
``hparams_seed`` k and the values ``sagm_jax.sweep.hparams.random_hparams`` draws for it, as
DomainBed's sweep does. Test environments: ``all`` (each environment alone),
``all_with_pairs`` (each alone and every pair, as DomainBed's sweep; leave-one-domain-out
selection needs the pairs), or explicit sets such as ``0 1 0,1``. ``--set`` and
``--grid`` may be repeated; each adds keys. Jobs run from the repository (config files
are relative to it).

The launchers (``sagm_jax.sweep.launchers``): ``--launcher local`` (default) runs
``--jobs N`` at a time, or one per GPU with ``--gpus 0,1,...`` (a ``--jobs`` beside it
that is not the number of GPUs is refused); ``--launcher slurm``
submits one SLURM array task per job through submitit (``--partition``,
``--gpus_per_job``, ``--time_min``, ...), requeued on preemption or at the time limit;
``--launcher submitit_local`` is the same path on this machine (submitit's local
executor). A job's output goes to ``out.txt`` / ``err.txt`` in its directory; a
failing job does not stop the others and is reported at the end (exit status 1).
``status`` lists every job with its last evaluated step, and the folders that are not
jobs of the grid.

Before ``launch`` (``--dry_run`` too) starts or writes anything, every job's config goes
through the checks ``sagm_jax.main`` runs (``sagm_jax.sweep.preflight``): any problem,
all of them listed at once with the --set / --grid flag or the jobs they come from,
exits 2. A job whose MLDG meta-test split leaves no meta-train domain is left out, one
line each.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from sagm_jax import methods
from sagm_jax.sweep import jobs as jobs_lib, launchers, packs, preflight
from sagm_jax.sweep.jobs import INCOMPLETE, PRESETS

# The --launcher slurm / submitit_local flags: make_executor's keyword arguments.
CLUSTER_OPTIONS = (
    "partition",
    "account",
    "gpus_per_job",
    "cpus_per_job",
    "mem_gb",
    "time_min",
    "array_parallelism",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.sweep",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["launch", "status", "delete_incomplete"])
    _grid_arguments(parser)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dry_run", action="store_true", help="List the commands; run nothing.")
    parser.add_argument("--yes", action="store_true", help="delete_incomplete without asking.")
    _launcher_arguments(parser)
    return parser.parse_args(argv)


def _grid_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that name the jobs: the grid and the overrides every job gets."""
    parser.add_argument(
        "--datasets",
        nargs="+",
        required=True,
        help=f"Datasets, each run from its config file: {', '.join(jobs_lib.CONFIG_FILES)}.",
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["sagm"],
        help="Update rules (sagm_jax.methods): "
        f"{', '.join(methods.UPDATE_RULES)}. Default: sagm.",
    )
    parser.add_argument(
        "--objectives",
        nargs="+",
        default=["erm"],
        help=f"Objectives (sagm_jax.methods): {', '.join(methods.OBJECTIVES)}; each "
        "combined with each update rule. Default: erm.",
    )
    parser.add_argument(
        "--disam_lambdas",
        nargs="+",
        type=float,
        default=[0.0],
        help="DISAM's weights (0 = off; DISAM acts on sam, gsam and sagm). Default: 0.",
    )
    parser.add_argument(
        "--test_envs",
        nargs="+",
        default=["all"],
        help="Held-out environment sets: all (each environment alone; the default), "
        "all_with_pairs (each alone and every pair, as DomainBed's sweep; leave-one-domain-"
        "out selection needs the pairs), or explicit sets such as 0 1 0,1.",
    )
    parser.add_argument(
        "--trial_seeds", nargs="+", type=int, default=[0], help="Split seeds. Default: 0."
    )
    parser.add_argument(
        "--hparams",
        choices=PRESETS,
        default="paper",
        help="paper: each config's own values; reduced: the paper's search space "
        "(ResNet datasets), a search around DomainBed's lr 1e-3 (MNIST-like ones); swad: "
        "the SWAD authors' 18-point grid, trial seed 0 only; random: DomainBed's random "
        "search, settings 0..n_hparams-1 (0 = DomainBed's defaults).",
    )
    parser.add_argument(
        "--n_hparams",
        type=int,
        help=f"--hparams random: settings per method, dataset and trial seed "
        f"(default {jobs_lib.DEFAULT_N_HPARAMS}, as DomainBed's sweep).",
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


def _launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the jobs run: local processes, or SLURM array tasks through submitit."""
    parser.add_argument(
        "--launcher",
        choices=["local", "slurm", "submitit_local"],
        default="local",
        help="local processes; SLURM array tasks through submitit; or submitit's local "
        "executor (the SLURM path on this machine).",
    )
    parser.add_argument(
        "--pack",
        type=int,
        default=1,
        metavar="R",
        help="Train the jobs that share a program up to R at a time in one process "
        "(sagm_jax.sweep.packs; they differ only in seeds, split, test environments and "
        "continuous hyperparameters). 1: one process per job.",
    )
    local = parser.add_argument_group("--launcher local")
    local.add_argument(
        "--jobs", type=int, help="Jobs at a time (default 1); with --gpus, one per GPU."
    )
    local.add_argument(
        "--gpus", help="Comma-separated GPU ids: one job per GPU at a time (no --jobs)."
    )
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


def make_jobs(args) -> list[jobs_lib.Job]:
    """The grid the arguments name (``ValueError`` on a bad one); prints one line per
    method combination the grid skips."""
    grid = jobs_lib.parse_assignments(args.grid, "--grid")
    fixed = {k: v[0] for k, v in jobs_lib.parse_assignments(args.set, "--set").items()}
    methods_axes = (args.objectives, args.algorithms, args.disam_lambdas)
    kept, skipped = jobs_lib.method_combinations(*methods_axes)
    for line in skipped:
        print(f"sweep: {line}", file=sys.stderr)
    if not kept:
        raise ValueError(
            "no combination of --objectives, --algorithms and --disam_lambdas is left."
        )
    if args.n_hparams is not None and args.hparams != "random":
        raise ValueError(f"--n_hparams {args.n_hparams} is for --hparams random.")
    seeds = jobs_lib.preset_trial_seeds(args.hparams, args.trial_seeds)
    if seeds != args.trial_seeds:
        print(
            f"sweep: --hparams {args.hparams} is searched with trial seed "
            f"{', '.join(map(str, seeds))} only (the SWAD authors' protocol); --trial_seeds "
            f"{' '.join(map(str, args.trial_seeds))} ignored. Rerun the chosen setting with "
            "--hparams paper --set ... for the other trial seeds.",
            file=sys.stderr,
        )
    axes = (args.datasets, args.algorithms, args.test_envs, args.trial_seeds)
    return jobs_lib.make_jobs(
        *axes,
        grid,
        fixed,
        args.output_dir,
        objectives=args.objectives,
        disam_lambdas=args.disam_lambdas,
        hparams_preset=args.hparams,
        n_hparams=jobs_lib.DEFAULT_N_HPARAMS if args.n_hparams is None else args.n_hparams,
    )


def checked_jobs(args, jobs: list[jobs_lib.Job]) -> tuple[list[jobs_lib.Job], list[str]]:
    """The jobs that can run, and the problems of the others (``sagm_jax.sweep.preflight``:
    the checks ``sagm_jax.main`` runs); prints one line per job left out."""
    report = preflight.check_jobs(jobs, preflight.Flags.from_items(args.set, args.grid))
    left_out = {id(job) for job, _ in report.skipped}
    for job, why in report.skipped:
        print(f"sweep: left out {job.describe([jobs_lib.HPARAMS_SEED])}: {why}", file=sys.stderr)
    return [job for job in jobs if id(job) not in left_out], report.problems


def refuse(problems: list[str]) -> int:
    """Every problem at once, as ``sagm_jax.main`` lists them; exit status 2."""
    print(
        f"sweep: {len(problems)} problem(s) in the jobs' configs; nothing was launched or "
        "written:",
        file=sys.stderr,
    )
    for i, problem in enumerate(problems, 1):
        print(f"  {i}. {problem}", file=sys.stderr)
    return 2


def show_status(args, jobs) -> int:
    print(jobs_lib.status_table(jobs, args.output_dir))
    unknown = jobs_lib.unknown_folders(jobs, args.output_dir)
    if unknown:
        print(
            f"\n{len(unknown)} folder(s) in {args.output_dir} are not jobs of this grid "
            "(launched with other arguments; what differs):"
        )
        print("\n".join("  " + line for line in unknown))
    return 0


def delete_incomplete(args, jobs) -> int:
    incomplete = [job for job in jobs if job.status() == INCOMPLETE]
    if not args.yes:
        answer = input(f"Delete {len(incomplete)} incomplete job directories? [y/N] ")
        if answer.strip().lower() != "y":
            return 1
    print(f"Deleted {len(jobs_lib.delete_incomplete(jobs))} incomplete job directories.")
    return 0


def submit(args, jobs) -> int:
    """``--launcher slurm`` / ``submitit_local``: one submitit job array."""
    try:
        cluster = "slurm" if args.launcher == "slurm" else "local"
        options = {name: getattr(args, name) for name in CLUSTER_OPTIONS}
        executor = launchers.make_executor(args.output_dir, cluster, **options)
    except RuntimeError as error:  # submitit finds no srun: not a SLURM machine
        print(f"sweep: --launcher {args.launcher}: {error}", file=sys.stderr)
        return 2
    submitted = launchers.submit(jobs, args.output_dir, executor)
    if submitted:
        print(
            f"Submitted {len(submitted)} jobs; logs in {args.output_dir}/.submitit/. "
            "`status` with the same arguments shows their progress."
        )
    if args.launcher == "submitit_local":
        outcomes = [task.result()["outcome"] for task in submitted]
        finished = (0, launchers.ALREADY_DONE, launchers.ELSEWHERE)
        return 0 if all(o in finished for o in outcomes) else 1
    return 0


def local_workers(args) -> tuple[int, list[str] | None]:
    """``(--jobs, the --gpus ids)`` of ``--launcher local``; ``ValueError`` on ids that
    are empty or repeated, ``--jobs`` below 1, or ``--jobs`` beside ``--gpus`` that is not
    their number: each GPU runs one job at a time (a second JAX process on one GPU finds
    most of its memory taken), so ``--gpus 0,1 --jobs 3`` cannot run 3 at a time."""
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: expected a number of jobs at a time >= 1.")
    if args.gpus is None:
        return args.jobs or 1, None
    gpus = [g.strip() for g in args.gpus.split(",")]
    if "" in gpus or len(set(gpus)) != len(gpus):
        raise ValueError(
            f"--gpus {args.gpus}: expected distinct comma-separated GPU ids such as 0,1."
        )
    if args.jobs is not None and args.jobs != len(gpus):
        raise ValueError(
            f"--jobs {args.jobs} with --gpus {args.gpus}: --gpus runs one job per GPU, "
            f"{len(gpus)} at a time; drop --jobs (or give {args.jobs} GPU ids). Two jobs "
            "on one GPU would each find most of its memory taken."
        )
    return len(gpus), gpus


def launch_here(args, jobs) -> int:
    """``--launcher local``: the jobs as processes of this machine."""
    workers, gpus = local_workers(args)
    result = launchers.launch(jobs, workers=workers, gpus=gpus)
    print(
        f"Summary: {len(result['finished'])} finished, {len(result['skipped'])} skipped "
        f"(done), {len(result['elsewhere'])} running elsewhere, {len(result['stopped'])} "
        f"stopped, {len(result['failed'])} failed."
    )
    for job, code in result["failed"]:
        print(f"  failed ({code}): {job.directory}")
    if result["stopped"]:
        print("Relaunch the same command to resume the stopped jobs.")
        return launchers.INTERRUPTED_EXIT
    return 1 if result["failed"] else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "launch" and args.launcher == "local":
            local_workers(args)
        jobs = make_jobs(args)
    except ValueError as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 2
    jobs, problems = checked_jobs(args, jobs)
    if problems and args.command == "launch":
        return refuse(problems)
    if not jobs and args.command == "launch":
        print("sweep: no job is left to run.", file=sys.stderr)
        return 2
    if args.command == "status":
        return show_status(args, jobs)
    if args.command == "delete_incomplete":
        return delete_incomplete(args, jobs)
    if args.pack < 1:
        print(f"sweep: --pack {args.pack}: expected a pack size >= 1.", file=sys.stderr)
        return 2
    if args.pack > 1:
        jobs = packs.make_packs(jobs, args.output_dir, args.pack)
        print(f"sweep: --pack {args.pack}: the jobs by program (what sets each apart):")
        print("\n".join(packs.grouping_lines(jobs)))
    if args.dry_run:
        for job in jobs:
            if isinstance(job, packs.Pack):
                print(f"[{job.status()}] {job.describe()}: "
                      + shlex.join(job.command(range(len(job.jobs)))))
            else:
                print(f"[{job.status()}] " + shlex.join(job.command()))
        return 0
    if args.launcher != "local":
        return submit(args, jobs)
    return launch_here(args, jobs)


if __name__ == "__main__":
    sys.exit(main())
