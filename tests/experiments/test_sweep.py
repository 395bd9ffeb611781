"""The sweep launcher: job list and hashes, bookkeeping (skip, relaunch, failures,
GPU pinning, status), and one real tiny training job through its command."""

import json
import os
import sys

import pytest

from experiments import collect_results, sweep

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
    return sweep.make_jobs(**{**kwargs, **overrides})


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
    assert sweep.job_hash(dict(reversed(list(first.items())))) == expected


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
    assert sweep.test_env_sets(["all"], 3) == [[0], [1], [2]]
    assert sweep.test_env_sets(["all_with_pairs"], 3) == [[0], [0, 1], [0, 2], [1], [1, 2], [2]]
    assert sweep.test_env_sets(["1,0"], 3) == [[0, 1]]
    with pytest.raises(ValueError, match="'x'"):
        sweep.test_env_sets(["x"], 3)
    assert sweep.parse_assignments(["lr=1e-5,3e-5", "mixstyle=True,False"], "--grid") == {
        "lr": [1e-5, 3e-5],
        "mixstyle": [True, False],
    }
    assert sweep.parse_assignments(["arch=resnet50"], "--set") == {"arch": ["resnet50"]}
    with pytest.raises(ValueError, match="'lr'"):
        sweep.parse_assignments(["lr"], "--grid")
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
    log = tmp_path / "log.txt"
    assert [j.status() for j in jobs] == ["done", "incomplete", "not launched", "not launched"]
    table = sweep.status_table(jobs)
    assert "4 jobs: 1 done, 1 incomplete, 2 not launched" in table
    assert table.splitlines()[0].split() == ["status", "job", "lr", "test_envs"]

    result = sweep.launch(
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
    assert open(os.path.join(fresh.directory, "out.txt")).read() == "gpu None\n"
    assert [j.status() for j in jobs] == ["done", "done", "incomplete", "done"]
    assert [j.directory for j in sweep.delete_incomplete(jobs)] == [failing.directory]
    assert not os.path.exists(failing.directory)


def test_gpu_workers_pin_one_gpu_each(tmp_path):
    jobs = jobs_for(tmp_path, algorithms=["erm"])  # 8 jobs
    sweep.launch(
        jobs, gpus=["0", "1"], make_command=fake_command(tmp_path / "log"), log=lambda _: None
    )
    seen = [open(os.path.join(j.directory, "out.txt")).read().split()[1] for j in jobs]
    assert set(seen) <= {"0", "1"} and all(j.status() == "done" for j in jobs)


def test_cli_reports_bad_input(capsys):
    assert sweep.main(["status", "--datasets", "Nope", "--output_dir", "x"]) == 2
    assert "'Nope'" in capsys.readouterr().err


def test_one_real_tiny_job(tmp_path, monkeypatch):
    """The launcher's real command trains (2 steps of RotatedDigits) and the collector
    reads what it wrote."""
    monkeypatch.setenv("XLA_FLAGS", "")  # one CPU device for the subprocess
    jobs = sweep.make_jobs(
        ["RotatedDigits"],
        ["sagm"],
        ["0"],
        [0],
        {},
        {"steps": 2, "eval_every": 1, "batch_per_env": 8, "eval_batch_size": 64},
        str(tmp_path / "sweep"),
    )
    result = sweep.launch(jobs, log=lambda _: None)
    err = open(os.path.join(jobs[0].directory, "err.txt")).read()
    assert result["finished"] == jobs, err[-2000:]
    records = [json.loads(line) for line in open(os.path.join(jobs[0].directory, "results.jsonl"))]
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["args"]["test_envs"] == [0] and records[0]["hparams"]["batch_per_env"] == 8
    assert sweep.launch(jobs, log=lambda _: None)["skipped"] == jobs  # done: not run again
    report = collect_results.build_report(str(tmp_path / "sweep"))
    assert "| SAGM | " in report and "(1/1)" not in report
