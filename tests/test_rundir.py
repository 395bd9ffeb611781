"""sagm_jax.rundir: records that survive a torn write, and the config check."""

import json
import os

import pytest

from sagm_jax import rundir


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _records(*steps):
    return "".join(json.dumps({"loss": 1.0, "step": s}) + "\n" for s in steps)


def test_a_torn_last_line_is_dropped_and_rewritten_on_resume(tmp_path):
    # The disk filled in the middle of the third record.
    _write(tmp_path / rundir.RESULTS, _records(0, 2) + '{"step": 4, "lo')
    with pytest.warns(UserWarning, match="results.jsonl: dropped a torn last line"):
        assert [r["step"] for r in rundir.read_records(str(tmp_path))] == [0, 2]
    # The resumed run (restored at step 3) keeps steps 0 and 2 and repeats step 4.
    with pytest.warns(UserWarning):
        kept = rundir.RunDir(str(tmp_path)).records_before(3)
    assert [r["step"] for r in kept] == [0, 2]
    with open(tmp_path / rundir.RESULTS) as f:
        assert f.read() == _records(0, 2)  # whole lines only
    assert [r["step"] for r in rundir.read_records(str(tmp_path))] == [0, 2]


def test_a_complete_json_last_line_without_newline_counts_as_torn(tmp_path):
    _write(tmp_path / rundir.RESULTS, _records(0) + json.dumps({"step": 2}))
    with pytest.warns(UserWarning, match="without its newline"):
        assert [r["step"] for r in rundir.read_records(str(tmp_path))] == [0]


def test_a_bad_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / rundir.RESULTS
    _write(path, _records(0) + "garbage\n" + _records(2))
    with pytest.raises(rundir.RecordsError, match=rf"{path}, line 2: not a JSON record"):
        rundir.read_records(str(tmp_path))


def test_records_are_appended_whole_and_only_by_the_main_process(tmp_path):
    main, other = rundir.RunDir(str(tmp_path)), rundir.RunDir(str(tmp_path), is_main=False)
    main.append({"step": 0})
    other.append({"step": 1})
    with open(tmp_path / rundir.RESULTS) as f:
        assert f.read() == '{"step": 0}\n'


def test_another_config_is_refused_naming_the_keys(tmp_path):
    run = rundir.RunDir(str(tmp_path))
    run.check_config({"lr": 1.0})  # an empty directory holds no config
    rundir.write_json(os.path.join(tmp_path, rundir.CONFIG), {"lr": 1.0, "test_envs": [0]})
    run.check_config({"lr": 1.0, "test_envs": (0,)})  # a tuple is the JSON list
    with pytest.raises(ValueError, match=r"different config \(keys \['lr', 'test_envs'\]"):
        run.check_config({"lr": 2.0, "test_envs": (1,)})


def test_a_record_is_domainbeds_with_the_setting_and_the_whole_config(tmp_path):
    config = {
        "dataset": "PACS",
        "algorithm": "sagm",
        "test_envs": (1,),
        "all_test_envs": False,
        "trial_seed": 2,
        "seed": 2,
        "batch_per_env": 32,
        "lr": 3e-5,
    }
    record = rundir.make_record(
        config,
        str(tmp_path),
        step=99,
        loss=0.5,
        accuracies={"env0_in_acc": 0.75},
        test_envs=[1],
        smallest_env=1600,
    )
    assert record == {
        "step": 99,
        "loss": 0.5,
        "epoch": 100 * 32 / 1600,
        "env0_in_acc": 0.75,
        "args": {
            "dataset": "PACS",
            "algorithm": "sagm",
            "test_envs": [1],
            "trial_seed": 2,
            "seed": 2,
            "hparams_seed": rundir.hparams_seed(config),
            "output_dir": str(tmp_path),
        },
        "hparams": {"dataset": "PACS", "algorithm": "sagm", "batch_per_env": 32, "lr": 3e-5},
        "config": config,
    }
    # The setting's name ignores what differs between its runs, and only that.
    same_setting = {**config, "test_envs": (0, 1), "trial_seed": 0, "seed": 0}
    assert rundir.hparams_seed(same_setting) == rundir.hparams_seed(config)
    assert rundir.hparams_seed({**config, "lr": 1e-5}) != rundir.hparams_seed(config)


def test_find_runs_lists_every_run_with_its_records_and_done(tmp_path):
    """Runs at any depth, the root included; DomainBed's (records only) too; a torn last
    line dropped; checkpoint folders and folders without run files are not runs."""
    _write(tmp_path / rundir.CONFIG, "{}")
    _write(tmp_path / rundir.RESULTS, _records(0))
    finished = tmp_path / "sweep" / "a"
    torn = tmp_path / "sweep" / "b"
    started = tmp_path / "sweep" / "c"
    for folder in (finished, torn, started, finished / rundir.CHECKPOINTS / "4", tmp_path / "x"):
        os.makedirs(folder)
    _write(finished / rundir.RESULTS, _records(0, 4))
    _write(finished / rundir.DONE, "done\n")
    _write(finished / rundir.CHECKPOINTS / "4" / rundir.RESULTS, _records(9))
    _write(torn / rundir.RESULTS, _records(0, 2) + '{"step": 4, "lo')
    _write(started / rundir.CONFIG, "{}")
    with pytest.warns(UserWarning, match=r"sweep/b/results.jsonl: dropped a torn last line"):
        runs = rundir.find_runs(str(tmp_path))
    assert [(os.path.relpath(r.path, tmp_path), r.done, r.last_step) for r in runs] == [
        (".", False, 0),
        (os.path.join("sweep", "a"), True, 4),
        (os.path.join("sweep", "b"), False, 2),
        (os.path.join("sweep", "c"), False, None),
    ]
    assert rundir.find_runs(str(tmp_path / "nowhere")) == []
