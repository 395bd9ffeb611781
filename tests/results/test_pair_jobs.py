"""Leave-one-domain-out's missing pair runs: the commands the report suggests launch
exactly them, each once, with the runs' own overrides.

The sweep here is sweep jobs as ``python -m sagm_jax.sweep launch --set steps=21``
leaves them: a folder ``md5(json.dumps(args, sort_keys=True))`` (DomainBed's job name)
with ``args.json``, ``done`` and one record. The missing runs are restated here by
leave-one-domain-out's rule (the single run's own arguments with ``test_envs`` the pair
(t, v), for each other environment v that has no such run), and each suggested
command's ``--dry_run`` job list is read back from what it prints.
"""

import hashlib
import json
import shlex

from sagm_jax.results import collect as collect_results
from sagm_jax.sweep import jobs as sweep_jobs
from sagm_jax.sweep.__main__ import main as sweep_main

CONFIG, ENVS = "configs/colored_mnist.py", 3  # ColoredMNIST: three environments
# (method arguments, the test environment sets run, trial seeds, lr values)
RUNS = [
    ({"algorithm": "sam"}, [[0]], [0, 1], [None]),
    ({"algorithm": "erm", "objective": "coral"}, [[0], [1], [0, 1]], [0], [None]),
    ({"algorithm": "sagm", "disam_lambda": 0.1}, [[2]], [0], [1e-3, 3e-4]),
]


def job_args(method, envs, seed, lr) -> dict:
    args = {"config": CONFIG, **method, "test_envs": envs, "trial_seed": seed, "seed": seed}
    return {**args, "steps": 21, **({"lr": lr} if lr else {})}


def job_name(args) -> str:
    return hashlib.md5(json.dumps(args, sort_keys=True).encode("utf-8")).hexdigest()


def write_sweep(root) -> list[dict]:
    """The sweep's job folders under ``root``; returns their arguments."""
    made = []
    for method, env_sets, seeds, lrs in RUNS:
        for envs in env_sets:
            for seed in seeds:
                for lr in lrs:
                    args = job_args(method, envs, seed, lr)
                    folder = root / job_name(args)
                    folder.mkdir()
                    (folder / "args.json").write_text(json.dumps(args))
                    config = {k: v for k, v in args.items() if k != "config"}
                    config.update(dataset="ColoredMNIST", all_test_envs=False)
                    record = {"step": 20, "config": config, "hparams": {}}
                    record["args"] = {"dataset": "ColoredMNIST", "hparams_seed": 0, **config}
                    for env in range(ENVS):
                        record.update({f"env{env}_in_acc": 0.5, f"env{env}_out_acc": 0.5})
                    (folder / "results.jsonl").write_text(json.dumps(record) + "\n")
                    (folder / "done").write_text("")
                    made.append(args)
    return made


def missing_runs(made: list[dict]) -> list[dict]:
    """Leave-one-domain-out's rule: for each single run (t,), the pair runs (t, v) of its
    arguments that the sweep does not hold."""
    have = {job_name(a) for a in made}
    missing = {}
    for args in made:
        if len(args["test_envs"]) == 1:
            t = args["test_envs"][0]
            for v in set(range(ENVS)) - {t}:
                pair = {**args, "test_envs": sorted([t, v])}
                if job_name(pair) not in have:
                    missing[job_name(pair)] = pair
    return sorted(missing.values(), key=job_name)


def note_commands(report: str) -> list[str]:
    """The commands of the report's leave-one-domain-out note."""
    note = report.split("- Leave-one-domain-out needs", 1)[1].split("\n- ", 1)[0]
    head, *lines = note.split("\n")
    if " with: " in head:
        return [head.split(" with: ", 1)[1]]
    return [line.strip() for line in lines if line.startswith("  python ")]


def dry_run_jobs(command: str, capsys) -> list[tuple[str, dict]]:
    """``(workdir, {config key: value})`` of each job that ``command --dry_run`` lists."""
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "sagm_jax.sweep"], command
    capsys.readouterr()
    assert sweep_main(words[3:] + ["--dry_run"]) == 0, capsys.readouterr().err
    jobs = []
    for line in capsys.readouterr().out.splitlines():
        words = shlex.split(line.split("] ", 1)[1])
        flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
        overrides = {
            k[len("config.") :]: sweep_jobs.parse_value(v)
            for k, v in flags.items()
            if k.startswith("config.")
        }
        jobs.append((flags["workdir"], {"config": flags["config"], **overrides}))
    return jobs


def test_the_suggested_commands_launch_exactly_the_missing_runs_with_their_overrides(
    tmp_path, capsys
):
    made = write_sweep(tmp_path)
    report = collect_results.build_report(str(tmp_path), "leave_one_out")
    commands = note_commands(report)
    # One command per method: no grid holds sam and CORAL's erm together, and DISAM's
    # two lr values are one --grid.
    assert len(commands) == 3, commands
    launched = [job for command in commands for job in dry_run_jobs(command, capsys)]
    expected = missing_runs(made)
    assert len(expected) == 4 + 2 + 4
    assert sorted((args for _, args in launched), key=job_name) == expected
    assert sorted(workdir for workdir, _ in launched) == sorted(
        str(tmp_path / job_name(args)) for args in expected
    )
    assert f"Add the {len(expected)} missing pair runs, and no other" in report
    # LaTeX: the note's every line is a comment.
    latex = collect_results.build_report(str(tmp_path), "leave_one_out", latex=True)
    note = latex.split("% Leave-one-domain-out needs", 1)[1]
    assert all(line.startswith("% ") for line in note.strip().splitlines()[1:])


def test_one_method_and_setting_is_one_command(tmp_path, capsys):
    """SAM alone: one command, with explicit pairs, that lists exactly the missing runs."""
    made = write_sweep(tmp_path)
    for args in made:
        if args["algorithm"] != "sam":
            for path in (tmp_path / job_name(args)).iterdir():
                path.unlink()
            (tmp_path / job_name(args)).rmdir()
    made = [args for args in made if args["algorithm"] == "sam"]
    report = collect_results.build_report(str(tmp_path), "leave_one_out")
    [command] = note_commands(report)
    assert "--test_envs 0,1 0,2" in command and "--set steps=21" in command
    launched = sorted((args for _, args in dry_run_jobs(command, capsys)), key=job_name)
    assert launched == missing_runs(made)
