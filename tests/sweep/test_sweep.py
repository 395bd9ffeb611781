"""sagm_jax.sweep: job list and hashes, bookkeeping (skip, relaunch, failures,
GPU pinning, status), exactly-once runs (two launchers at once, a killed launcher,
SIGTERM), repeated --set, the submitit path (local executor, requeue after a time
limit, the SLURM batch script), one real tiny training job through its command, and the
--hparams presets (per dataset, the SWAD grid with trial seed 0, the random search)."""

import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from sagm_jax.sweep import jobs as sweep_jobs, launchers
from sagm_jax.sweep.__main__ import main as sweep_main, make_jobs, parse_args
from run_fixtures import write_image_tree

GRID = {"lr": [1e-5, 3e-5], "alpha": [1e-3, 5e-4]}


def jobs_for(output_dir, **overrides):
    kwargs = dict(
        datasets=["PACS"],
        algorithms=["erm", "sagm"],
        test_envs=["0", "1"],
        trial_seeds=[0, 1],
        grid=GRID,
        fixed={"steps": 301},
        output_dir=output_dir,
    )
    return sweep_jobs.make_jobs(**{**kwargs, **overrides})


def test_job_list_hashes_are_stable_unique_and_domainbeds(tmp_path):
    jobs = jobs_for(tmp_path)
    # erm ignores alpha: 2 lr; sagm: 2 lr x 2 alpha; x 2 test envs x 2 seeds.
    assert len(jobs) == (2 + 4) * 2 * 2
    assert len({job.directory for job in jobs}) == len(jobs)
    assert [j.directory for j in jobs] == [j.directory for j in jobs_for(tmp_path)]
    first = jobs[0].args
    assert first == {
        "config": "configs/pacs.py",
        "algorithm": "erm",
        "test_envs": [0],
        "trial_seed": 0,
        "seed": 0,
        "lr": 1e-5,
        "steps": 301,
    }
    import hashlib

    expected = hashlib.md5(json.dumps(first, sort_keys=True).encode()).hexdigest()
    assert jobs[0].directory == os.path.join(str(tmp_path), expected)
    # A hash depends on the arguments' values, not their order.
    assert sweep_jobs.job_hash(dict(reversed(list(first.items())))) == expected


def test_command_overrides_every_argument(tmp_path):
    job = jobs_for(tmp_path, algorithms=["sagm"])[0]
    command = job.command()
    assert command[1:5] == [
        "-m",
        "sagm_jax.main",
        "--config=configs/pacs.py",
        f"--workdir={job.directory}",
    ]
    assert set(command[5:]) == {
        "--config.algorithm=sagm",
        "--config.alpha=0.001",
        "--config.lr=1e-05",
        "--config.seed=0",
        "--config.steps=301",
        "--config.test_envs=(0,)",
        "--config.trial_seed=0",
    }


def test_test_env_sets_and_value_parsing():
    assert sweep_jobs.test_env_sets(["all"], 3) == [[0], [1], [2]]
    pairs = [[0], [0, 1], [0, 2], [1], [1, 2], [2]]
    assert sweep_jobs.test_env_sets(["all_with_pairs"], 3) == pairs
    assert sweep_jobs.test_env_sets(["1,0"], 3) == [[0, 1]]
    with pytest.raises(ValueError, match="'x'"):
        sweep_jobs.test_env_sets(["x"], 3)
    assert sweep_jobs.parse_assignments(["lr=1e-5,3e-5", "mixstyle=True,False"], "--grid") == {
        "lr": [1e-5, 3e-5],
        "mixstyle": [True, False],
    }
    assert sweep_jobs.parse_assignments(["arch=resnet50"], "--set") == {"arch": ["resnet50"]}
    with pytest.raises(ValueError, match="'lr'"):
        sweep_jobs.parse_assignments(["lr"], "--grid")
    with pytest.raises(ValueError, match="--set lr"):
        jobs_for("out", fixed={"lr": 1e-3})


# A stand-in for the training command where the test is about the launcher's
# bookkeeping: it appends its workdir to a log, fails for one job, else writes `done`.
FAKE = """
import os, sys
workdir = sys.argv[1]
with open(sys.argv[2], "a") as f:
  f.write(workdir + "\\n")
print("gpu", os.environ.get("CUDA_VISIBLE_DEVICES"))
if workdir == sys.argv[3]:
  sys.exit(3)
open(os.path.join(workdir, "done"), "w").close()
"""


def fake_command(log, failing=""):
    return lambda job: [sys.executable, "-c", FAKE, job.directory, str(log), failing]


def test_launch_skips_done_relaunches_incomplete_and_reports_failures(tmp_path):
    jobs = jobs_for(tmp_path / "sweep", algorithms=["erm"], trial_seeds=[0])  # 4 jobs
    done, incomplete, failing, fresh = jobs
    os.makedirs(done.directory)
    open(os.path.join(done.directory, "done"), "w").close()
    os.makedirs(incomplete.directory)
    with open(os.path.join(incomplete.directory, "results.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 100}) + "\n")
    log = tmp_path / "log.txt"
    assert [j.status() for j in jobs] == ["done", "incomplete", "not launched", "not launched"]
    table = sweep_jobs.status_table(jobs, str(tmp_path / "sweep"))
    assert "4 jobs: 1 done, 0 running, 1 incomplete, 2 not launched" in table
    assert table.splitlines()[0].split() == ["status", "job", "step", "lr", "test_envs"]
    column = table.index("step")
    steps = [line[column:].split()[0] for line in table.splitlines()[1:5]]
    assert steps == ["-", "100", "-", "-"]  # the last evaluated step, from rundir.find_runs

    result = launchers.launch(
        jobs, workers=2, make_command=fake_command(log, failing.directory), log=lambda _: None
    )
    ran = sorted(log.read_text().split())
    assert ran == sorted([incomplete.directory, failing.directory, fresh.directory])
    assert result["skipped"] == [done]
    assert sorted(j.directory for j in result["finished"]) == sorted(
        [incomplete.directory, fresh.directory]
    )
    assert [(j.directory, code) for j, code in result["failed"]] == [(failing.directory, 3)]
    assert json.load(open(os.path.join(fresh.directory, "args.json"))) == fresh.args
    out = open(os.path.join(fresh.directory, "out.txt")).read().splitlines()
    assert out[0].startswith("=== ") and out[-1] == "gpu None"  # a header per launch
    assert [j.status() for j in jobs] == ["done", "done", "incomplete", "done"]
    assert [j.directory for j in sweep_jobs.delete_incomplete(jobs)] == [failing.directory]
    assert not os.path.exists(failing.directory)


def test_gpu_workers_pin_one_gpu_each(tmp_path):
    jobs = jobs_for(tmp_path, algorithms=["erm"])  # 8 jobs
    launchers.launch(
        jobs, gpus=["0", "1"], make_command=fake_command(tmp_path / "log"), log=lambda _: None
    )
    seen = [open(os.path.join(j.directory, "out.txt")).read().split()[-1] for j in jobs]
    assert set(seen) <= {"0", "1"} and all(j.status() == "done" for j in jobs)


def test_cli_reports_bad_input(capsys):
    assert sweep_main(["status", "--datasets", "Nope", "--output_dir", "x"]) == 2
    assert "'Nope'" in capsys.readouterr().err


# The launcher's real command (python -m sagm_jax.main) trains two jobs, is skipped once
# they are done, and both collectors read what they wrote:
# tests/results/test_domainbed_records.py::test_domainbeds_reader_prints_tables_from_our_sweep.


# --- exactly once: claims, several launchers, kills -------------------------------
# Launchers run as separate processes, as a user starts them; their jobs are FAKE_JOB,
# which notes its start and end in a shared log (O_APPEND), prints to out.txt and
# err.txt, and stops like sagm_jax.main (exit 130) on SIGTERM.

LAUNCHER = """
import json, sys
from sagm_jax.sweep import jobs as sweep_jobs, launchers
spec = json.load(open(sys.argv[1]))
jobs = [sweep_jobs.Job(args, spec["output_dir"]) for args in spec["jobs"]]
command = lambda job: [
    sys.executable, spec["fake"], job.directory, spec["log"], str(spec["seconds"])]
result = launchers.launch(
    jobs, workers=spec["workers"], make_command=command, log=lambda m: print(m, flush=True))
print("RESULT " + json.dumps({k: len(v) for k, v in result.items()}), flush=True)
"""

FAKE_JOB = """
import os, signal, sys, time
workdir, log, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
def note(word):
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{word} {os.path.basename(workdir)}\\n".encode())
    os.close(fd)
def stop(signum, frame):
    note("stopped")
    sys.exit(130)
signal.signal(signal.SIGTERM, stop)
note("start")
for i in range(5):
    print("out", i, flush=True)
    print("err", i, file=sys.stderr, flush=True)
    time.sleep(seconds / 5)
open(os.path.join(workdir, "done"), "w").close()
note("end")
"""


def start_launcher(tmp_path, jobs, seconds, workers=1, name="spec"):
    fake = tmp_path / "fake_job.py"
    fake.write_text(FAKE_JOB)
    spec = tmp_path / f"{name}.json"
    spec.write_text(
        json.dumps(
            {
                "jobs": [job.args for job in jobs],
                "output_dir": os.path.dirname(jobs[0].directory),
                "fake": str(fake),
                "log": str(tmp_path / "log.txt"),
                "seconds": seconds,
                "workers": workers,
            }
        )
    )
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(spec)], stdout=subprocess.PIPE, text=True
    )


def finish(launcher, timeout=120):
    out, _ = launcher.communicate(timeout=timeout)
    result = json.loads(out.split("RESULT ")[1])
    return out, result


def log_lines(tmp_path):
    path = tmp_path / "log.txt"
    return path.read_text().splitlines() if path.exists() else []


def wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_two_launchers_on_one_folder_run_every_job_exactly_once(tmp_path):
    jobs = jobs_for(tmp_path / "sweep", algorithms=["erm"])  # 8 jobs
    first = start_launcher(tmp_path, jobs, seconds=1, workers=2, name="a")
    second = start_launcher(tmp_path, jobs, seconds=1, workers=2, name="b")
    (out_a, a), (out_b, b) = finish(first), finish(second)
    assert a["finished"] > 0 and b["finished"] > 0  # they did compete
    starts = [line for line in log_lines(tmp_path) if line.startswith("start")]
    assert sorted(starts) == sorted(f"start {os.path.basename(j.directory)}" for j in jobs)
    assert a["finished"] + b["finished"] == 8 and a["failed"] == b["failed"] == 0
    for job in jobs:
        assert job.status() == "done"
        for name, word in (("out.txt", "out"), ("err.txt", "err")):
            text = open(os.path.join(job.directory, name)).read()
            assert "\x00" not in text
            lines = text.splitlines()
            assert lines[0].startswith("=== ") and lines[1:] == [f"{word} {i}" for i in range(5)]
    # Progress: [n/N], the job, and an ETA once a job has finished.
    assert "] start   PACS erm test_envs=0 trial_seed=0 lr=1e-05" in out_a + out_b
    assert "ETA " in out_a + out_b


def test_a_killed_launchers_job_keeps_its_claim_and_finishes_once(tmp_path):
    jobs = jobs_for(tmp_path / "sweep", algorithms=["erm"], test_envs=["0"], trial_seeds=[0])
    job = jobs[0]
    jobs = [job]
    # Long enough that the orphan still runs while a second launcher starts on a loaded
    # machine (a job that ended meanwhile is counted done, not elsewhere).
    first = start_launcher(tmp_path, jobs, seconds=10, name="a")
    wait_for(lambda: log_lines(tmp_path) == [f"start {os.path.basename(job.directory)}"])
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert job.status() == "running"  # the orphaned job still holds the claim
    out, second = finish(start_launcher(tmp_path, jobs, seconds=0.1, name="b"))
    assert second["elsewhere"] == 1 and second["finished"] == 0
    assert "0 to run" in out
    wait_for(job.is_done)
    wait_for(lambda: job.status() == "done")
    assert [line.split()[0] for line in log_lines(tmp_path)] == ["start", "end"]
    _, third = finish(start_launcher(tmp_path, jobs, seconds=0.1, name="c"))
    assert third["skipped"] == 1 and len(log_lines(tmp_path)) == 2


def test_sigterm_stops_the_launcher_with_its_jobs_and_a_relaunch_resumes_them(tmp_path):
    jobs = jobs_for(tmp_path / "sweep", algorithms=["erm"], test_envs=["0"], trial_seeds=[0])
    job = jobs[0]
    first = start_launcher(tmp_path, [job], seconds=60, name="a")
    wait_for(lambda: len(log_lines(tmp_path)) == 1)
    first.send_signal(signal.SIGTERM)
    out, result = finish(first)
    assert result["stopped"] == 1 and "Stopping (SIGTERM)" in out
    assert [line.split()[0] for line in log_lines(tmp_path)] == ["start", "stopped"]
    assert job.status() == "incomplete"  # nobody holds it: the next launcher takes it
    _, again = finish(start_launcher(tmp_path, [job], seconds=0.1, name="b"))
    assert again["finished"] == 1 and job.status() == "done"
    assert [line.split()[0] for line in log_lines(tmp_path)] == ["start", "stopped", "start", "end"]


# --- --set, status ----------------------------------------------------------------


def test_repeated_set_accumulates_and_a_key_given_twice_is_refused(tmp_path, capsys):
    # The README's Table 2 command: $W (two keys) then --set split=in_domain.
    argv = ["launch", "--dry_run", "--datasets", "PACS", "--algorithms", "sagm"]
    argv += ["--test_envs", "0", "--output_dir", str(tmp_path)]
    argv += ["--set", "data_dir=/data", "pretrained_weights=/w.pth", "--set", "split=in_domain"]
    assert sweep_main(argv) == 0
    command = capsys.readouterr().out
    for flag in ("data_dir=/data", "pretrained_weights=/w.pth", "split=in_domain"):
        assert f"--config.{flag}" in command
    assert sweep_main(argv + ["--set", "split=domainbed"]) == 2
    assert "--set split is given twice" in capsys.readouterr().err
    args = parse_args(argv + ["--grid", "lr=1e-5,3e-5", "--grid", "dropout=0,0.5"])
    assert args.grid == ["lr=1e-5,3e-5", "dropout=0,0.5"]


def test_status_explains_folders_that_are_not_jobs_of_the_grid(tmp_path, capsys):
    output = tmp_path / "sweep"
    other = jobs_for(output, algorithms=["erm"], test_envs=["0"], trial_seeds=[0])[0]
    os.makedirs(other.directory)
    with open(os.path.join(other.directory, "args.json"), "w") as f:
        json.dump({**other.args, "steps": 5001}, f)
    (output / "stray").mkdir()
    argv = ["status", "--datasets", "PACS", "--algorithms", "erm", "--test_envs", "0"]
    assert sweep_main(argv + ["--output_dir", str(output), "--set", "steps=301"]) == 0
    out = capsys.readouterr().out
    assert "2 folder(s) in" in out and "are not jobs of this grid" in out
    assert "steps=5001 (this grid: 301)" in out
    assert "stray  not a job folder (no args.json)" in out


# --- the cluster path: submitit ---------------------------------------------------


def fake_task_command(log, first_seconds):
    """A job that runs ``first_seconds`` on its first launch and finishes at once when
    launched again (as a resumed run would)."""
    script = (
        "import os, signal, sys, time\n"
        "workdir, log, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
        "def note(w):\n"
        "    with open(log, 'a') as f: f.write(w + '\\n')\n"
        "def stop(*_):\n"
        "    note('stopped'); sys.exit(130)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "again = os.path.exists(os.path.join(workdir, 'ran_once'))\n"
        "open(os.path.join(workdir, 'ran_once'), 'w').close()\n"
        "note('resumed' if again else 'start')\n"
        "time.sleep(0 if again else seconds)\n"
        "open(os.path.join(workdir, 'done'), 'w').close()\n"
        "note('end')\n"
    )
    return lambda job: [sys.executable, "-c", script, job.directory, str(log), str(first_seconds)]


def test_cluster_path_through_submitits_local_executor(tmp_path, monkeypatch):
    """The task is pickled by reference to sagm_jax.sweep.launchers and unpickled by a
    fresh process started elsewhere, with no PYTHONPATH: the installed package is
    all it needs."""
    import submitit

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)

    output = str(tmp_path / "sweep")
    jobs = jobs_for(output, algorithms=["erm"], test_envs=["0"], trial_seeds=[0])  # 2 lrs
    executor = submitit.LocalExecutor(folder=str(tmp_path / "logs" / "%j"))
    executor.update_parameters(timeout_min=2)
    log = tmp_path / "log.txt"
    tasks = launchers.submit(jobs, output, executor, fake_task_command(log, 0), log=lambda _: None)
    assert [task.result()["outcome"] for task in tasks] == [0, 0]
    assert all(job.status() == "done" for job in jobs)
    assert launchers.submit(jobs, output, executor, log=lambda _: None) == []  # all done


def test_a_preempted_cluster_task_stops_its_run_requeues_and_resumes(tmp_path):
    import submitit

    output = str(tmp_path / "sweep")
    job = jobs_for(output, algorithms=["erm"], test_envs=["0"], trial_seeds=[0])[0]
    # The time limit's signal (USR2) comes 6 s after the start, as SLURM's would before
    # the limit; the task stops the run and submitit requeues the task.
    executor = submitit.LocalExecutor(folder=str(tmp_path / "logs" / "%j"), max_num_timeout=2)
    executor.update_parameters(timeout_min=12 / 60, signal_delay_s=6)
    log = tmp_path / "log.txt"
    command = fake_task_command(log, 60)
    (task,) = launchers.submit([job], output, executor, command, log=lambda _: None)
    assert task.result()["outcome"] == 0, task.stdout()
    assert log.read_text().split() == ["start", "stopped", "resumed", "end"]
    assert job.status() == "done"


def test_slurm_submission_is_one_array_task_per_job_with_the_flags(tmp_path, monkeypatch):
    """submitit's SLURM executor against stand-ins for srun and sbatch: the batch script
    it submits carries the launcher's flags."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\ncp "$1" {tmp_path}/script.sh\necho "Submitted batch job 4242"\n'
    )
    for tool in ("srun", "sbatch"):
        os.chmod(bin_dir / tool, 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    output = str(tmp_path / "sweep")
    jobs = jobs_for(output, algorithms=["erm"], test_envs=["0"], trial_seeds=[0, 1])[:3]
    executor = launchers.make_executor(
        output,
        "slurm",
        partition="gpu",
        account="lab",
        gpus_per_job=2,
        time_min=90,
        array_parallelism=2,
    )
    tasks = launchers.submit(jobs, output, executor, log=lambda _: None)
    assert [task.job_id for task in tasks] == ["4242_0", "4242_1", "4242_2"]
    script = (tmp_path / "script.sh").read_text()
    for line in (
        "#SBATCH --array=0-2%2",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --time=90",
        "#SBATCH --signal=USR2@120",
    ):
        assert line in script, line
    assert "PYTHONPATH" not in script  # the task unpickles from the installed package


def test_slurm_launcher_off_a_cluster_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    argv = [
        "launch",
        "--datasets",
        "PACS",
        "--algorithms",
        "erm",
        "--test_envs",
        "0",
        "--set",
        "pretrained_weights=resnet50.safetensors",
    ]  # a run's own check
    assert sweep_main(argv + ["--output_dir", str(tmp_path), "--launcher", "slurm"]) == 2
    assert "--launcher slurm" in capsys.readouterr().err


def test_gsam_sweeps_its_own_alpha_and_sagm_its_own(tmp_path):
    grid = {"alpha": [1e-3, 5e-4], "gsam_alpha": [0.01, 0.05]}
    jobs = jobs_for(tmp_path, algorithms=["gsam", "sagm", "erm_sam"], test_envs=["0"], grid=grid)
    keys = {
        algorithm: [
            sorted(set(j.args) - set(sweep_jobs.SWEEP_KEYS))
            for j in jobs
            if j.args["algorithm"] == algorithm
        ]
        for algorithm in ("gsam", "sagm", "erm_sam")
    }
    assert keys["gsam"] == [["gsam_alpha", "steps"]] * 2 * 2  # 2 gsam_alpha x 2 seeds
    assert keys["sagm"] == [["alpha", "steps"]] * 2 * 2
    assert keys["erm_sam"] == [["steps"]] * 2  # SAGM with alpha 0 sweeps neither


def test_sweep_takes_its_names_from_the_registries():
    from sagm_jax import methods
    from sagm_jax.data import registry

    assert methods.owners("rho") == methods.rule_names("head")  # swept for the heads only
    assert sweep_jobs.grid_points({"rho": [0.05, 0.1], "lr": [1e-3]}, "erm") == [{"lr": 1e-3}]
    assert len(sweep_jobs.grid_points({"rho": [0.05, 0.1], "lr": [1e-3]}, "sam")) == 2
    assert sweep_jobs.CONFIG_FILES == registry.CONFIG_FILES  # ImageFolder's too
    assert {sweep_jobs.num_environments(n) for n in ("RotatedMNIST", "RotatedDigits")} == {6}
    assert sweep_jobs.num_environments("ColoredMNIST") == 3
    assert sweep_jobs.num_environments("PACS") == 4


def test_the_command_runs_from_anywhere_as_a_module(tmp_path):
    """``python -m sagm_jax.sweep`` from another folder, without PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "sagm_jax.sweep", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m sagm_jax.sweep")
    assert "{launch,status,delete_incomplete}" in out.stdout


def test_help_documents_the_grid_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    # The description above "options:" also names these words: read the options only.
    options = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    datasets = options.split("--datasets", 1)[1].split("--algorithms", 1)[0]
    assert "RotatedDigits" in datasets and "PACS" in datasets
    algorithms = options.split("--algorithms", 1)[1].split("--objectives", 1)[0]
    assert "fish" in algorithms and "and_mask" in algorithms and "sagm_jax.methods" in algorithms
    objectives = options.split("--objectives", 1)[1].split("--disam_lambdas", 1)[0]
    assert "coral" in objectives and "vrex" in objectives and "Default: erm" in objectives
    assert "0 = off" in options.split("--disam_lambdas", 1)[1].split("--test_envs", 1)[0]
    test_envs = options.split("--test_envs", 1)[1].split("--trial_seeds", 1)[0]
    assert "all_with_pairs" in test_envs and "all" in test_envs and "0,1" in test_envs


# --- methods: update rules x objectives x DISAM -------------------------------------


def method_jobs(tmp_path, argv):
    base = ["launch", "--datasets", "PACS", "--test_envs", "0", "--output_dir", str(tmp_path)]
    return make_jobs(parse_args(base + argv))


def test_every_update_rule_and_objective_is_reachable_and_refusals_are_skipped(tmp_path, capsys):
    from sagm_jax import methods

    argv = ["--algorithms", *methods.UPDATE_RULES, "--objectives", *methods.OBJECTIVES]
    jobs = method_jobs(tmp_path, argv + ["--disam_lambdas", "0", "0.1"])
    made = {
        (j.args["algorithm"], j.args.get("objective", "erm"), j.args.get("disam_lambda", 0))
        for j in jobs
    }
    # Procedures take objective erm only; DISAM acts on sam, gsam and sagm only.
    expected = {
        (a, o, d)
        for a in methods.UPDATE_RULES
        for o in methods.OBJECTIVES
        for d in (0, 0.1)
        if (a not in methods.rule_names("procedure") or o == "erm")
        and (d == 0 or a in ("sam", "gsam", "sagm"))
    }
    assert made == expected and len(jobs) == len(expected)
    skipped = capsys.readouterr().err.splitlines()
    total = len(methods.UPDATE_RULES) * len(methods.OBJECTIVES) * 2
    assert len(skipped) == total - len(expected)
    assert "sweep: skipped objective=coral algorithm=fish disam_lambda=0.0: " in "\n".join(skipped)
    assert all(line.startswith("sweep: skipped objective=") for line in skipped)


def test_objective_and_disam_join_a_jobs_arguments_only_when_not_the_default(tmp_path):
    """A sweep launched before objectives existed keeps its job folders."""
    argv = ["--algorithms", "sagm", "--objectives", "erm", "coral", "--disam_lambdas", "0", "0.1"]
    jobs = method_jobs(tmp_path, argv + ["--set", "steps=301"])
    plain = next(j for j in jobs if set(j.args) == {*sweep_jobs.SWEEP_KEYS, "steps"})
    old = jobs_for(tmp_path, algorithms=["sagm"], test_envs=["0"], trial_seeds=[0], grid={})
    assert plain.directory == old[0].directory
    both = next(j for j in jobs if "objective" in j.args and "disam_lambda" in j.args)
    assert (both.args["objective"], both.args["disam_lambda"]) == ("coral", 0.1)
    assert {"--config.objective=coral", "--config.disam_lambda=0.1"} <= set(both.command())
    assert len({j.directory for j in jobs}) == len(jobs) == 4


def test_a_methods_own_hyperparameters_are_swept_for_it_alone(tmp_path):
    argv = ["--algorithms", "erm", "fish", "sagm", "--objectives", "erm", "mixup"]
    grid = ["--grid", "lr=1e-5,3e-5", "mixup_alpha=0.1,0.2", "fish_meta_lr=0.1,0.5"]
    jobs = method_jobs(tmp_path, argv + grid)
    keys = {}
    for j in jobs:
        method = (j.args["algorithm"], j.args.get("objective", "erm"))
        keys.setdefault(method, []).append(sorted(set(j.args) - set(sweep_jobs.SWEEP_KEYS)))
    assert keys[("erm", "erm")] == [["lr"]] * 2
    assert keys[("erm", "mixup")] == [["lr", "mixup_alpha", "objective"]] * 4
    assert keys[("fish", "erm")] == [["fish_meta_lr", "lr"]] * 4
    assert keys[("sagm", "mixup")] == [["lr", "mixup_alpha", "objective"]] * 4
    assert ("fish", "mixup") not in keys  # refused


def test_bad_method_arguments_are_named(tmp_path, capsys):
    for argv, expected in (
        (["--objectives", "nope"], "--objectives 'nope'"),
        (["--algorithms", "swad"], "--algorithms 'swad'"),
        (["--disam_lambdas", "-1"], "each must be >= 0"),
        (["--algorithms", "fish", "--objectives", "coral"], "no combination"),
        (["--grid", "objective=erm,coral"], "--grid objective"),
        (["--set", "disam_lambda=0.1"], "--set disam_lambda"),
    ):
        out = sweep_main(["status", "--datasets", "PACS", "--output_dir", str(tmp_path), *argv])
        assert out == 2 and expected in capsys.readouterr().err, argv


# --- --hparams presets: per dataset; the SWAD grid; DomainBed's random search ---------


def preset_jobs(tmp_path, datasets, algorithms, argv):
    base = ["launch", "--datasets", *datasets, "--algorithms", *algorithms, "--test_envs", "0"]
    return make_jobs(parse_args(base + ["--output_dir", str(tmp_path), *argv]))


def swept(jobs, keys=("lr", "dropout", "weight_decay", "alpha")):
    """Each job's values of ``keys`` (None where it has none)."""
    return sorted(tuple(j.args.get(k) for k in keys) for j in jobs)


def test_reduced_is_the_papers_space_on_resnets_and_around_lr_1e3_on_the_mnist_cnn(tmp_path):
    resnet = preset_jobs(tmp_path, ["PACS"], ["sagm"], ["--hparams", "reduced"])
    lrs, dropouts, decays, alphas = [1e-5, 3e-5, 5e-5], [0.0, 0.1, 0.5], [1e-4, 1e-6], [1e-3, 5e-4]
    product = itertools.product(lrs, dropouts, decays, alphas)
    assert swept(resnet) == sorted(product) and len(resnet) == 36
    # The ResNet grid names the same job folders as before it became per dataset.
    old = {"lr": lrs, "dropout": dropouts, "weight_decay": decays, "alpha": alphas}
    same = jobs_for(
        tmp_path, algorithms=["sagm"], test_envs=["0"], trial_seeds=[0], grid=old, fixed={}
    )
    assert {j.directory for j in resnet} == {j.directory for j in same}
    for dataset in ("RotatedMNIST", "ColoredMNIST", "RotatedDigits"):
        mnist = preset_jobs(tmp_path, [dataset], ["sagm", "erm"], ["--hparams", "reduced"])
        sagm = [j for j in mnist if j.args["algorithm"] == "sagm"]
        lrs = [3e-4, 1e-3, 3e-3]
        assert swept(sagm) == sorted((lr, None, None, a) for lr in lrs for a in [1e-3, 5e-4])
        erm = [j for j in mnist if j.args["algorithm"] == "erm"]
        assert swept(erm) == [(lr, None, None, None) for lr in lrs]


def test_swad_grid_is_18_points_searched_with_trial_seed_0_only(tmp_path, capsys):
    argv = ["--hparams", "swad", "--trial_seeds", "0", "1", "2"]
    jobs = preset_jobs(tmp_path, ["PACS", "DomainNet"], ["erm", "sagm"], argv)
    assert "trial seed 0 only" in capsys.readouterr().err
    grid = sorted(
        (lr, p, wd, None)
        for lr in (1e-5, 3e-5, 5e-5)
        for p in (0.0, 0.1, 0.5)
        for wd in (1e-4, 1e-6)
    )
    for dataset, algorithm in itertools.product(("pacs", "domain_net"), ("erm", "sagm")):
        mine = [
            j
            for j in jobs
            if j.args["config"] == f"configs/{dataset}.py" and j.args["algorithm"] == algorithm
        ]
        assert swept(mine) == grid and len(mine) == 18
        assert {j.args["trial_seed"] for j in mine} == {j.args["seed"] for j in mine} == {0}
    preset_jobs(tmp_path, ["PACS"], ["erm"], ["--hparams", "swad"])
    assert capsys.readouterr().err == ""  # trial seed 0 asked for: nothing to say
    code = sweep_main(
        ["status", "--datasets", "RotatedMNIST", "--output_dir", str(tmp_path), "--hparams", "swad"]
    )
    assert code == 2 and "for the ResNet datasets" in capsys.readouterr().err


def test_random_search_sets_each_jobs_hparams_seed_and_its_draws(tmp_path):
    from sagm_jax.sweep.hparams import random_hparams

    argv = ["--hparams", "random", "--n_hparams", "4", "--trial_seeds", "0", "1"]
    jobs = preset_jobs(tmp_path, ["PACS", "RotatedMNIST"], ["erm", "fish"], argv)
    assert len(jobs) == 2 * 2 * 2 * 4 and len({j.directory for j in jobs}) == len(jobs)
    for job in jobs:
        args, seed = job.args, job.args["hparams_seed"]
        dataset = sweep_jobs.DATASET_OF[args["config"]]
        drawn = random_hparams(args["algorithm"], dataset, seed, args["trial_seed"])
        own = set(args) - {*sweep_jobs.SWEEP_KEYS, "hparams_seed"}
        assert own == set(drawn) and all(args[k] == drawn[k] for k in own)
        assert f"--config.hparams_seed={seed}" in job.command()
    pacs_erm = [
        j.args
        for j in jobs
        if j.args["config"] == "configs/pacs.py" and j.args["algorithm"] == "erm"
    ]
    assert [a["hparams_seed"] for a in pacs_erm] == [0, 1, 2, 3] * 2
    # Setting 0 is DomainBed's defaults for ResNets, whichever the trial seed.
    for args in (a for a in pacs_erm if a["hparams_seed"] == 0):
        assert (args["lr"], args["batch_per_env"], args["weight_decay"], args["dropout"]) == (
            5e-5,
            32,
            0.0,
            0.0,
        )
    # The other settings are drawn per trial seed, as DomainBed's are.
    first, second = pacs_erm[1], pacs_erm[5]
    assert first["hparams_seed"] == second["hparams_seed"] == 1
    assert first["lr"] != second["lr"]
    mnist = [j.args for j in jobs if j.args["config"] == "configs/rotated_mnist.py"]
    assert all("dropout" not in a for a in mnist)


def test_random_search_with_disam_draws_one_lambda(tmp_path):
    argv = ["--hparams", "random", "--n_hparams", "3", "--disam_lambdas", "0", "0.1"]
    jobs = preset_jobs(tmp_path, ["PACS"], ["sagm"], argv)
    disam = [j.args for j in jobs if "disam_lambda" in j.args]
    assert len(jobs) == 6 and [a["hparams_seed"] for a in disam] == [0, 1, 2]
    assert disam[0]["disam_lambda"] == 0.1  # setting 0: the lambda given
    assert all(0.01 <= a["disam_lambda"] <= 1 for a in disam) and disam[1]["disam_lambda"] != 0.1


def test_bad_preset_arguments_are_named(tmp_path, capsys):
    for argv, expected in (
        (["--hparams", "random", "--grid", "lr=1e-5,3e-5"], "--grid lr with --hparams random"),
        (["--hparams", "random", "--set", "hparams_seed=3"], "--set hparams_seed"),
        (["--hparams", "random", "--n_hparams", "0"], "--n_hparams 0"),
        (["--hparams", "reduced", "--n_hparams", "5"], "is for --hparams random"),
        (
            ["--hparams", "random", "--algorithms", "sagm", "--disam_lambdas", "0.1", "0.2"],
            "give 0 and/or one positive value",
        ),
    ):
        out = sweep_main(["status", "--datasets", "PACS", "--output_dir", str(tmp_path), *argv])
        assert out == 2 and expected in capsys.readouterr().err, argv


def dry_run_args(out: str) -> list[dict]:
    """The ``--config.KEY=VALUE`` of each command that ``launch --dry_run`` printed."""
    jobs = []
    for line in out.splitlines():
        if line.startswith("[") and "sagm_jax.main" in line:
            words = shlex.split(line.split("] ", 1)[1])
            pairs = [
                w[len("--config.") :].split("=", 1) for w in words if w.startswith("--config.")
            ]
            jobs.append({k: sweep_jobs.parse_value(v) for k, v in pairs})
    return jobs


def test_a_sweep_of_ones_own_image_folder_takes_its_domains_as_environments(tmp_path, capsys):
    """ImageFolder: the environments are the domain folders of --set data_dir (three
    here), each job's command carries data_dir, and the jobs pass main's checks."""
    write_image_tree(tmp_path / "data")  # art, photo, sketch
    tiny = ["arch=mnist_cnn", "pretrained_weights=none", "image_size=16", "steps=2"]
    argv = ["launch", "--datasets", "ImageFolder", "--output_dir", str(tmp_path / "sweep")]
    argv += ["--algorithms", "erm", "--dry_run", "--set", *tiny]
    data_dir = f"data_dir={tmp_path / 'data'}"
    assert sweep_main(argv + [data_dir, "--test_envs", "all_with_pairs"]) == 0
    jobs = dry_run_args(capsys.readouterr().out)
    assert sorted(tuple(j["test_envs"]) for j in jobs) == [(0,), (0, 1), (0, 2), (1,), (1, 2), (2,)]
    assert {j["data_dir"] for j in jobs} == {str(tmp_path / "data")}
    assert sweep_main(argv) == 2  # no data_dir
    assert "--datasets ImageFolder needs --set data_dir=DIR" in capsys.readouterr().err
    assert sweep_main(argv + [f"data_dir={tmp_path / 'none'}"]) == 2
    assert f"--set data_dir={tmp_path / 'none'}: expected a folder" in capsys.readouterr().err


def test_gpus_with_another_number_of_jobs_is_refused(tmp_path, capsys):
    """--gpus runs one job per GPU: a --jobs that is not their number cannot be honoured
    and exits 2 naming both; the same number, or no --jobs, is accepted."""
    argv = ["launch", "--datasets", "RotatedDigits", "--test_envs", "0", "--dry_run"]
    argv += ["--output_dir", str(tmp_path)]
    assert sweep_main(argv + ["--gpus", "0,1", "--jobs", "3"]) == 2
    err = capsys.readouterr().err
    assert "--jobs 3 with --gpus 0,1: --gpus runs one job per GPU, 2 at a time" in err
    for bad, said in (["--jobs", "0"], "--jobs 0: expected"), (["--gpus", "0,0"], "--gpus 0,0"):
        assert sweep_main(argv + bad) == 2 and said in capsys.readouterr().err
    assert sweep_main(argv + ["--gpus", "0,1", "--jobs", "2"]) == 0
    assert sweep_main(argv + ["--gpus", "0,1"]) == 0
