"""sagm_jax.training.rundir: records that survive a torn write, and the config check."""

import json
import os

import pytest

from sagm_jax.training import rundir


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


def test_a_relaunch_that_changes_eval_splits_is_refused_naming_the_recorded_value(tmp_path):
    """The parts a record holds are eval_splits': one run's records hold one kind, so a
    change is refused (config.json is kept). A config.json written before the key
    existed evaluated every part: it is an "all" run."""
    run = rundir.RunDir(str(tmp_path))
    config = {"lr": 1.0, "eval_splits": "fast"}
    rundir.write_json(os.path.join(tmp_path, rundir.CONFIG), config)
    run.check_config(config)
    with pytest.raises(
        ValueError, match=r"keys \['eval_splits'\] differ.*--config.eval_splits=fast\.$"
    ):
        run.check_config({**config, "eval_splits": "all"})
    assert rundir.read_config(str(tmp_path)) == config
    # Written before eval_splits existed: "all" is the same run, the new default is not.
    rundir.write_json(os.path.join(tmp_path, rundir.CONFIG), {"lr": 1.0})
    run.check_config({"lr": 1.0, "eval_splits": "all"})
    with pytest.raises(ValueError, match=r"keys \['eval_splits'\] differ.*eval_splits='all'"):
        run.check_config({"lr": 1.0, "eval_splits": "fast"})
    with pytest.raises(ValueError, match=r"keys \['lr'\] differ.*directory\.$"):
        run.check_config({"lr": 2.0, "eval_splits": "all"})  # no eval_splits hint


def test_args_algorithm_is_the_methods_label_and_the_setting_keeps_its_hash(tmp_path):
    """DomainBed's collector makes one row per ``args.algorithm``: a record writes the
    whole method there (DomainBed's name CORAL, not the update rule erm, which stays in
    ``config.algorithm``). ``args.hparams_seed`` hashes the config, as before the label
    (the value below is what the records of this config held then); a sweep's job hash
    hashes the job's arguments, which hold no record."""
    config = {
        "dataset": "PACS",
        "objective": "coral",
        "algorithm": "erm",
        "disam_lambda": 0.0,
        "mixstyle": False,
        "test_envs": [0],
        "all_test_envs": False,
        "trial_seed": 0,
        "seed": 0,
        "batch_per_env": 32,
        "lr": 5e-5,
    }
    evaluation = {"step": 0, "loss": 1.0, "accuracies": {}, "test_envs": [0], "smallest_env": 100}
    record = rundir.make_record(config, str(tmp_path), **evaluation)
    assert record["args"]["algorithm"] == "CORAL"
    assert record["config"]["algorithm"] == "erm"
    assert record["args"]["hparams_seed"] == rundir.hparams_seed(config) == 1325761871
    labels = {
        ("mixup", "erm"): "Mixup",
        ("erm", "and_mask"): "ANDMask",
        ("coral", "sagm"): "SAGM + CORAL",
        ("erm", "fish"): "Fish",
    }
    for (objective, algorithm), label in labels.items():
        method = {**config, "objective": objective, "algorithm": algorithm}
        assert rundir.record_algorithm(method) == label
    assert rundir.record_algorithm({**config, "algorithm": "sagm", "mixstyle": True}) == (
        "SAGM + CORAL + MixStyle"
    )


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
            "algorithm": "SAGM",  # the method's label (rundir.record_algorithm)
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


# --- records a reader can check: lost, repeated and unreadable lines -------------------
# A run of steps=9, eval_every=2 evaluates after steps 0, 2, 4, 6 and 8 (the last, 8, is
# also a multiple); one of steps=8 after 0, 2, 4, 6 and 7 (the last).


def _trainer_records(*steps, config=None):
    config = config or {"steps": 9, "eval_every": 2}
    return "".join(json.dumps({"step": s, "loss": 1.0, "config": config}) + "\n" for s in steps)


def _finished_run(folder, text):
    os.makedirs(folder, exist_ok=True)
    _write(folder / rundir.RESULTS, text)
    _write(folder / rundir.DONE, "done\n")


def test_a_deleted_record_of_a_done_run_is_named(tmp_path):
    _finished_run(tmp_path, _trainer_records(0, 2, 6, 8))  # `sed -i 3d`: step 4 lost
    with pytest.raises(rundir.RecordsError, match=r"results.jsonl: .*missing step\(s\) \[4\]"):
        rundir.read_records(str(tmp_path))
    # A finished run needs its last evaluation too; steps=8 ends with step 7.
    _finished_run(tmp_path, _trainer_records(0, 2, 4, 6, config={"steps": 8, "eval_every": 2}))
    with pytest.raises(rundir.RecordsError, match=r"missing step\(s\) \[7\]"):
        rundir.read_records(str(tmp_path))
    _finished_run(tmp_path, _trainer_records(0, 2, 4, 6, 7, config={"steps": 8, "eval_every": 2}))
    assert [r["step"] for r in rundir.read_records(str(tmp_path))] == [0, 2, 4, 6, 7]


def test_a_repeated_record_is_named(tmp_path):
    _finished_run(tmp_path, _trainer_records(0, 2, 4, 4, 6, 8))
    with pytest.raises(rundir.RecordsError, match=r"results.jsonl: .*repeated step\(s\) \[4\]"):
        rundir.read_records(str(tmp_path))


def test_an_unfinished_run_holds_a_prefix_of_its_evaluations(tmp_path):
    _write(tmp_path / rundir.RESULTS, _trainer_records(0, 2, 4))
    assert [r["step"] for r in rundir.read_records(str(tmp_path))] == [0, 2, 4]
    _write(tmp_path / rundir.RESULTS, _trainer_records(0, 4, 6))
    with pytest.raises(rundir.RecordsError, match=r"missing step\(s\) \[2\]"):
        rundir.read_records(str(tmp_path))
    _write(tmp_path / rundir.RESULTS, _trainer_records(0, 3))
    with pytest.raises(rundir.RecordsError, match=r"unexpected step\(s\) \[3\]"):
        rundir.read_records(str(tmp_path))


def test_a_resumed_run_does_not_skip_the_evaluation_whose_record_was_lost(tmp_path):
    """Restored at step 5 (the checkpoint of step 4), the run needs the records of
    steps 0, 2 and 4; the record of step 4 was deleted, so that evaluation would never
    be made again."""
    _write(tmp_path / rundir.RESULTS, _trainer_records(0, 2))
    with pytest.raises(rundir.RecordsError, match=r"results.jsonl: .*missing step\(s\) \[4\]"):
        rundir.RunDir(str(tmp_path)).records_before(5)
    _write(tmp_path / rundir.RESULTS, _trainer_records(0, 2, 2, 4))
    with pytest.raises(rundir.RecordsError, match=r"repeated step\(s\) \[2\]"):
        rundir.RunDir(str(tmp_path)).records_before(5)
    with open(tmp_path / rundir.RESULTS) as f:
        assert f.read() == _trainer_records(0, 2, 2, 4)  # refused, not rewritten
    # Records after the checkpoint (killed between the record and its save) still go.
    _write(tmp_path / rundir.RESULTS, _trainer_records(0, 2, 4, 6))
    assert [r["step"] for r in rundir.RunDir(str(tmp_path)).records_before(5)] == [0, 2, 4]


def test_find_runs_refuses_a_run_with_a_gap(tmp_path):
    _finished_run(tmp_path / "sweep" / "a", _trainer_records(0, 2, 4, 6, 8))
    _finished_run(tmp_path / "sweep" / "b", _trainer_records(0, 2, 4, 8))
    expected = r"sweep/b/results.jsonl: .*missing step\(s\) \[6\]"
    with pytest.raises(rundir.RecordsError, match=expected):
        rundir.find_runs(str(tmp_path))


def test_records_without_a_config_follow_domainbeds_rules(tmp_path):
    """DomainBed's own records carry no config: their steps are not checked here."""
    _finished_run(tmp_path, _records(0, 300, 300, 4999))
    assert [r["step"] for r in rundir.read_records(str(tmp_path))] == [0, 300, 300, 4999]


def test_a_binary_results_file_names_the_file_and_the_line(tmp_path):
    path = tmp_path / rundir.RESULTS
    with open(path, "wb") as f:
        f.write(_records(0).encode() + b"\x91\x00\xfe binary\n" + _records(2).encode())
    with pytest.raises(rundir.RecordsError, match=rf"{path}, line 2: not UTF-8 text"):
        rundir.read_records(str(tmp_path))
    # One binary line without a newline is no torn record (records are ASCII): refused,
    # never dropped and rewritten.
    with open(path, "wb") as f:
        f.write(b"\x91\x92\x93")
    with pytest.raises(rundir.RecordsError, match=rf"{path}, line 1: not UTF-8 text"):
        rundir.RunDir(str(tmp_path)).records_before(0)
    with open(path, "rb") as f:
        assert f.read() == b"\x91\x92\x93"


# --- split.json: the data a run started on -------------------------------------------------


def _tiny_folder(root, n=4):
    from PIL import Image

    for domain in ("art", "photo"):
        for cls in ("cat", "dog"):
            os.makedirs(root / domain / cls)
            for k in range(n):
                Image.new("RGB", (8, 8), (k, 0, 0)).save(root / domain / cls / f"{k}.png")


def _folder_dataset(tmp_path):
    from sagm_jax.data import load

    return load(
        "ImageFolder",
        str(tmp_path / "data"),
        trial_seed=0,
        cache_dir=str(tmp_path / "cache"),
        open_images=None,
    )


def test_a_changed_dataset_is_named_against_split_json(tmp_path):
    from sagm_jax.data import splits

    _tiny_folder(tmp_path / "data")
    run = str(tmp_path / "run")
    splits.write_split_record(run, _folder_dataset(tmp_path))
    splits.check_split_record(run, _folder_dataset(tmp_path))  # the same data passes
    data = tmp_path / "data" / "art"
    os.rename(data / "cat" / "0.png", data / "dog" / "9.png")  # a file moved to another class
    with pytest.raises(splits.DataChangedError) as error:
        splits.check_split_record(run, _folder_dataset(tmp_path))
    assert str(error.value).startswith(os.path.join(run, rundir.SPLIT))
    assert "environment `art`: class `cat`: 4 -> 3, class `dog`: 4 -> 5" in str(error.value)
    assert "environment `photo`" not in str(error.value)
    os.rename(data / "dog" / "9.png", data / "cat" / "9.png")  # same counts, another name
    with pytest.raises(splits.DataChangedError, match="list of image files differs"):
        splits.check_split_record(run, _folder_dataset(tmp_path))
    os.remove(os.path.join(run, rundir.SPLIT))
    with pytest.raises(splits.DataChangedError, match=r"split.json: cannot read"):
        splits.check_split_record(run, _folder_dataset(tmp_path))
