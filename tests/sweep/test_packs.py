"""The sweep's packs (sagm_jax.sweep.packs): grouping, and a packed sweep against the same
sweep unpacked."""

import os
import re
import shutil
import sys

from sagm_jax.results import collect as collect_results
from sagm_jax.sweep import packs
from sagm_jax.sweep.__main__ import main as sweep_main
from sagm_jax.sweep.jobs import DONE, make_jobs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "training"))
from test_packed import assert_records_agree  # noqa: E402


def test_jobs_are_packed_by_program_in_their_order(tmp_path):
    """Two update rules x three test environments x two learning rates, packs of up to 4:
    the learning rate and the test environment vary inside a pack, the rule does not; a
    per-device-perturbation job is never packed; the lines name what sets each program
    apart."""
    jobs = make_jobs(
        ["RotatedDigits"], ["erm", "sagm"], ["0", "1", "2"], [0],
        {"lr": [1e-3, 3e-3]}, {}, str(tmp_path),
    )
    items = packs.make_packs(jobs, str(tmp_path), 4)
    sizes = [(item.jobs[0].args["algorithm"], len(item.jobs)) for item in items]
    assert sizes == [("erm", 4), ("erm", 2), ("sagm", 4), ("sagm", 2)]
    for item in items:
        assert {job.args["algorithm"] for job in item.jobs} == {item.jobs[0].args["algorithm"]}
    assert packs.grouping_lines(items) == [
        "  algorithm=erm: 6 jobs in 2 process(es) of 4, 2 run(s)",
        "  algorithm=sagm: 6 jobs in 2 process(es) of 4, 2 run(s)",
    ]
    per_device = make_jobs(
        ["RotatedDigits"], ["sagm"], ["0", "1"], [0], {}, {"perturbation": "per_device"},
        str(tmp_path),
    )
    assert all(not isinstance(item, packs.Pack)
               for item in packs.make_packs(per_device, str(tmp_path), 4))


def _tables(output_dir) -> str:
    """collect_results' report, less the line that names the folder."""
    report = collect_results.build_report(str(output_dir), "training_domain", False, "±", False,
                                          False)
    return report.replace(str(output_dir), "DIR")


NUMBER = re.compile(r"\d+\.\d")


def test_a_packed_sweep_gives_the_unpacked_sweeps_results(tmp_path, capsys):
    """SAGM on three test environments, launched one process per job and with
    ``--pack 3``, one job of the packed sweep found done (copied from the other sweep):
    the pack trains only its other two runs, every job's records agree
    (``assert_records_agree``) and the result tables agree to their last digit but for
    two predictions (the same tables, measured on the 2-core CPU)."""
    grid = [
        "launch", "--datasets", "RotatedDigits", "--algorithms", "sagm",
        "--test_envs", "0", "1", "2", "--trial_seeds", "0",
        "--set", "steps=5", "--set", "eval_every=2",
    ]
    alone, packed = tmp_path / "alone", tmp_path / "packed"
    assert sweep_main([*grid, "--output_dir", str(alone), "--jobs", "2"]) == 0
    jobs = make_jobs(["RotatedDigits"], ["sagm"], ["0", "1", "2"], [0], {},
                     {"steps": 5, "eval_every": 2}, str(alone))
    done_first = jobs[0]
    shutil.copytree(done_first.directory, packed / os.path.basename(done_first.directory))
    before = os.stat(packed / os.path.basename(done_first.directory) / "results.jsonl")
    capsys.readouterr()
    assert sweep_main([*grid, "--output_dir", str(packed), "--jobs", "2", "--pack", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 jobs: 1 done" in out and "in 1 pack" in out
    after = os.stat(packed / os.path.basename(done_first.directory) / "results.jsonl")
    assert after.st_mtime_ns == before.st_mtime_ns  # the done lane was not touched
    for job in jobs:
        name = os.path.basename(job.directory)
        assert (packed / name / "done").exists() and job.status() == DONE
        assert_records_agree(packed / name, alone / name, name)
    got, want = _tables(packed), _tables(alone)
    assert NUMBER.sub("#", got) == NUMBER.sub("#", want)  # the same tables, rows and columns
    for g, w in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True):
        assert abs(float(g) - float(w)) <= 3.4, (g, w)  # two of 59 predictions, in %


class _Executor:
    """Stands in for a submitit executor: keeps what is submitted."""

    def __init__(self):
        self.tasks = []

    def batch(self):
        import contextlib

        return contextlib.nullcontext()

    def submit(self, task):
        self.tasks.append(task)
        return type("Submitted", (), {"job_id": str(len(self.tasks))})()


def test_slurm_submits_one_array_task_per_pack(tmp_path):
    """With packs, each array task is a pack: its jobs' arguments in lane order, its
    command made once it has claimed them."""
    from sagm_jax.sweep import launchers

    jobs = make_jobs(["RotatedDigits"], ["erm", "sagm"], ["0", "1", "2"], [0], {}, {},
                     str(tmp_path))
    items = packs.make_packs(jobs, str(tmp_path), 3)
    executor = _Executor()
    launchers.submit(items, str(tmp_path), executor, log=lambda _: None)
    assert [len(task.args) for task in executor.tasks] == [3, 3]
    assert [args["algorithm"] for args in executor.tasks[0].args] == ["erm"] * 3
    assert executor.tasks[0].args == [job.args for job in items[0].jobs]
    assert all(task.command is None for task in executor.tasks)
