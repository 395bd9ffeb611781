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
