"""sagm_jax.sweep.preflight: every job's config checked as its run checks it, before launch."""

import os

import pytest

from sagm_jax.sweep.__main__ import main as sweep_main


def run_sweep(tmp_path, capsys, *argv):
    output = tmp_path / "sweep"
    code = sweep_main(
        ["launch", "--datasets", "RotatedDigits", "--algorithms", "erm",
         "--output_dir", str(output), *argv]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err, output


@pytest.mark.parametrize("dry_run", [[], ["--dry_run"]])
def test_bad_sets_and_grids_are_all_named_and_nothing_is_launched_or_written(
    tmp_path, capsys, dry_run
):
    code, out, err, output = run_sweep(
        tmp_path, capsys, "--set", "stepz=3", "swad=maybe", "--grid", "steps=0,5", *dry_run
    )
    assert code == 2 and out == "" and not os.path.exists(output)
    assert "3 problem(s) in the jobs' configs; nothing was launched or written" in err
    assert "--set stepz=3: --config.stepz: no such key in configs/rotated_digits.py; " in err
    assert "did you mean `steps`?" in err
    assert "--set swad=maybe: flag --config.swad=maybe: " in err
    assert "(config.swad expects bool values)" in err
    assert "--grid steps=0,5: config.steps=0: expected a positive integer" in err


def test_a_combination_the_sweep_chose_names_the_jobs(tmp_path, capsys):
    code, _, err, _ = run_sweep(
        tmp_path, capsys, "--objectives", "coral", "--set", "batch_per_env=1", "--dry_run"
    )
    assert code == 2 and "--set batch_per_env=1: config.batch_per_env=1 with " in err
    code, _, err, _ = run_sweep(tmp_path, capsys, "--set", "swad=True", "--dry_run")
    assert code == 0  # a warning is the run's to print, not a refusal


def test_an_mldg_split_that_cannot_fit_leaves_out_its_jobs_one_line_each(tmp_path, capsys):
    argv = ["launch", "--datasets", "ColoredMNIST", "--algorithms", "mldg", "--hparams",
            "random", "--n_hparams", "4", "--output_dir", str(tmp_path), "--dry_run"]
    assert sweep_main(argv) == 0
    captured = capsys.readouterr()
    left_out = [line for line in captured.err.splitlines() if "left out" in line]
    commands = captured.out.splitlines()
    assert len(left_out) + len(commands) == 3 * 4 and left_out and commands
    assert left_out[0].startswith("sweep: left out ColoredMNIST mldg test_envs=0 trial_seed=0 ")
    assert "mldg_n_meta_test=2 leaves no meta-train domain among its 2 training" in left_out[0]
    assert all("--config.mldg_n_meta_test=1" in command for command in commands)
    # The default split fits no job of ColoredMNIST: nothing is left to launch.
    assert sweep_main(argv[:5] + argv[-3:]) == 2
    assert "sweep: no job is left to run." in capsys.readouterr().err


def test_a_set_of_one_methods_hyperparameter_names_the_jobs_of_another(tmp_path, capsys):
    # `sagm_jax.main` refuses --config.alpha for a SAM run (alpha is SAGM's alone): the
    # sweep says so before launching, naming the --set.
    code, _, err, _ = run_sweep(
        tmp_path, capsys, "--algorithms", "sam", "sagm", "--set", "alpha=5e-4", "--dry_run"
    )
    assert code == 2, err
    assert ("--set alpha=5e-4: --config.alpha=0.0005: alpha is a hyperparameter of update "
            "rule sagm, not of this run's objective erm and update rule sam") in err, err
    code, _, err, _ = run_sweep(
        tmp_path, capsys, "--algorithms", "sagm", "--set", "alpha=5e-4", "--dry_run"
    )
    assert code == 0, err
