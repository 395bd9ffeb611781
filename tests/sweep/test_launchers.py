"""sagm_jax.sweep.launchers: the progress lines and outcomes with two launchers on a folder."""

import os

from sagm_jax import claims
from sagm_jax.sweep import launchers
from sagm_jax.sweep.jobs import CLAIM, Job
from sagm_jax.training import rundir


def make_job(tmp_path, seed=0) -> Job:
    args = {"config": "configs/rotated_digits.py", "algorithm": "erm", "test_envs": [0],
            "trial_seed": seed, "seed": seed}
    return Job(args, str(tmp_path))


def finish(job: Job) -> None:
    os.makedirs(job.directory, exist_ok=True)
    open(os.path.join(job.directory, rundir.DONE), "w").close()


def test_the_progress_denominator_stays_when_another_launcher_takes_a_job(tmp_path):
    lines = []
    progress = launchers.Progress(3, 1, (), lines.append)
    job = make_job(tmp_path)
    n, start = progress.start(job)
    progress.skip()  # another job of the three turned out done elsewhere
    progress.end(n, start, job, 0)
    assert lines[0].startswith("[1/3] start ") and lines[1].startswith("[1/3] done ")
    assert lines[1].endswith("; 1 left") or "; 1 left, ETA" in lines[1]


def test_a_job_finished_while_its_process_still_holds_the_claim_is_done_not_elsewhere(
    tmp_path,
):
    job = make_job(tmp_path)
    held = claims.try_claim(job.directory, CLAIM)  # the other launcher's exiting job
    finish(job)
    with held:
        assert launchers.run_job(job, ["false"]) == launchers.ALREADY_DONE


def test_a_job_running_elsewhere_that_finishes_during_the_launch_is_counted_done(tmp_path):
    running, other = make_job(tmp_path, 0), make_job(tmp_path, 1)
    finish(other)
    held = claims.try_claim(running.directory, CLAIM)

    def log(line):  # the other launcher's job finishes once this launch has looked
        if line.endswith("to run (1 at a time)."):
            finish(running)

    with held:
        result = launchers.launch([running, other], log=log)
    assert result["elsewhere"] == [] and result["skipped"] == [other, running]
