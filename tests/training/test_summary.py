"""sagm_jax.training.summary: what a run prints when it ends (the selected step's accuracy
per environment and part, SWAD's beside it)."""

from sagm_jax.training import summary


def summary_record(step, accs, test_env):
    """A record whose 'out' accuracy is ``accs`` but 0 for ``test_env``; 'in' is ``accs``."""
    r = {"step": step}
    for env, acc in enumerate(accs):
        r[f"env{env}_in_acc"] = acc
        r[f"env{env}_out_acc"] = acc if env != test_env else 0.0
    return r


def test_summary_is_in_percent_with_the_selected_step(capsys):
    records = [summary_record(0, [0.1, 0.5, 0.5], 0), summary_record(10, [0.25, 0.8, 0.9], 0)]
    summary.print_summary(records, [0], ["art", "photo", "sketch"])
    out = capsys.readouterr().out
    assert "Selected step 10 by training-domain validation" in out and "85.0%" in out
    assert "env0 art (test)" in out and "25.0" in out and "90.0" in out
    assert "Test accuracy ('in' split of the test environment): env0 art 25.0%" in out


def test_summary_of_fast_records_shows_a_dash_and_says_why(capsys):
    """eval_splits="fast" records lack the training environments' 'in' parts: their cells
    are "-", with one line saying why; every number shown is the record's."""
    records = [summary_record(0, [0.1, 0.5, 0.5], 0), summary_record(10, [0.25, 0.8, 0.9], 0)]
    for r in records:
        del r["env1_in_acc"], r["env2_in_acc"]
        r["config"] = {"eval_splits": "fast"}
    swad_record = {
        "env0_in_acc": 0.375,
        "env0_out_acc": 0.125,
        "env1_out_acc": 0.625,
        "env2_out_acc": 0.875,
        "swad": {"segments": 3, "first_step": 2, "last_step": 10},
    }
    summary.print_summary(records, [0], ["art", "photo", "sketch"], swad_record)
    lines = capsys.readouterr().out.splitlines()
    header = "environment in % out % SWAD in % SWAD out %"
    assert lines[1].split() == header.split()
    rows = {line.split("(")[0].strip(): line.split(")")[1].split() for line in lines[2:5]}
    assert rows == {
        "env0 art": ["25.0", "0.0", "37.5", "12.5"],
        "env1 photo": ["-", "80.0", "-", "62.5"],
        "env2 sketch": ["-", "90.0", "-", "87.5"],
    }
    assert lines[5].strip() == (
        "- : training environments' 'in' parts are not evaluated (config.eval_splits=fast; "
        "--config.eval_splits=all evaluates every part)"
    )
    assert lines[6] == "Test accuracy ('in' split of the test environment): env0 art 25.0%"
    assert lines[7].startswith("SWAD test accuracy: env0 art 37.5% (the mean of 3 segments")
    # A part missing for another reason is named as missing, never put down to fast mode.
    del records[1]["env0_out_acc"]
    summary.print_summary(records[1:], [0], ["art", "photo", "sketch"])
    out = capsys.readouterr().out
    assert "  - : not in the records: env0 'out', env1 'in', env2 'in'" in out
    assert "eval_splits" not in out


def test_summary_of_all_split_records_has_no_dash(capsys):
    records = [summary_record(0, [0.1, 0.5, 0.5], 0), summary_record(10, [0.25, 0.8, 0.9], 0)]
    summary.print_summary(records, [0], ["art", "photo", "sketch"])
    out = capsys.readouterr().out
    assert " - " not in out and "not evaluated" not in out and "80.0" in out
