"""sagm_jax.averaging.soups: weight averages of finished runs. The uniform soup is the
float64 NumPy mean of its members' parameters (read from their checkpoints here); the
greedy selection is DiWA's restricted rule, re-stated below from alexrame/diwa
domainbed/scripts/diwa.py ``main``, on given scores and soup accuracies (ties
included), and on real runs with the soup's accuracy counted here by a forward pass;
members that differ are refused naming the run; a soup directory reads back through
``load_run`` and ``collect_results``."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from run_fixtures import assert_the_evaluation_reproduces_the_record, copy_run_with, digits_config

from sagm_jax.averaging import soups
from sagm_jax.results import records as records_lib
from sagm_jax.training import loading, packed, rundir

TRAIN_ENVS = (1, 2, 3, 4, 5)  # digits_config holds out environment 0
LRS = (1e-3, 3e-3, 2e-3)  # the members differ in their learning rate, as DiWA's do


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """Three finished SAGM runs of 5 steps from one initialisation (one seed), trained
    as one pack: their run directories."""
    root = tmp_path_factory.mktemp("soups")
    workdirs = [str(root / f"member{k}") for k in range(len(LRS))]
    configs = [digits_config(steps=5, eval_every=2, lr=lr) for lr in LRS]
    packed.train_pack(configs, workdirs)
    return workdirs


def _records(workdir):
    with open(os.path.join(workdir, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


def _selected(records):
    """DomainBed's training-domain validation: the first record of the highest mean
    ``out`` accuracy over the training environments (misc.get_score)."""
    scores = [np.mean([r[f"env{e}_out_acc"] for e in TRAIN_ENVS]) for r in records]
    return records[int(np.argmax(scores))], float(np.max(scores))


def _checkpoint_params(workdir, step):
    """A checkpoint's parameters, read with orbax, in float64."""
    path = os.path.join(workdir, "checkpoints", str(step), "default")
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(os.path.abspath(path))
    return jax.tree.map(lambda x: np.asarray(x, np.float64), restored["params"])


def _float64_mean(trees):
    return jax.tree.map(lambda *leaves: np.mean(np.stack(leaves), axis=0), *trees)


def _assert_params_equal(got, expected):
    for (key, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        assert np.asarray(a).dtype == np.float32, key
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-6, atol=1e-9,
                                   err_msg=jax.tree_util.keystr(key))


@pytest.mark.slow
def test_the_uniform_soup_is_the_float64_mean_of_the_members_parameters(members, tmp_path):
    out = str(tmp_path / "uniform")
    assert soups.main(["--out", out, "--selection", "uniform", *members]) == 0
    selected = [_selected(_records(w))[0]["step"] for w in members]
    expected = _float64_mean([_checkpoint_params(w, s) for w, s in zip(members, selected)])
    _, variables, record = loading.load_run(out, "best")
    _assert_params_equal(variables["params"], expected)
    # Its record is its own evaluation (argmax counted here on the unpadded batches).
    assert_the_evaluation_reproduces_the_record(out, "best")
    assert record["algorithm"] == record["args"]["algorithm"] == "SAGM + DiWA (uniform)"
    assert record["soup"]["accepted"] == [0, 1, 2]
    # Every split part of every environment (the members' records hold the "fast" ones).
    assert all(f"env{e}_{p}_acc" in record for e in range(6) for p in ("in", "out"))
    assert "env1_in_acc" not in _records(members[0])[0]
    info = rundir.read_run_info(out)
    assert [m["path"] for m in info["members"]] == [os.path.abspath(w) for w in members]
    assert [m["step"] for m in info["members"]] == selected


def diwa_restricted(dict_folder_to_score, wa_accuracy):
    """diwa.py ``main``'s "restricted" weight selection, re-stated: the folders sorted by
    decreasing score; each appended in turn; the weight average of the selected folders
    kept when its ``train`` accuracy is >= the best so far, else the folder popped.
    Returns the selected folders and each trial's accuracy."""
    ordered = sorted(dict_folder_to_score, key=lambda f: dict_folder_to_score[f], reverse=True)
    selected_indexes, best_result, trials = [], -float("inf"), []
    for i in range(len(ordered)):
        selected_indexes.append(i)
        result = wa_accuracy([ordered[j] for j in selected_indexes])
        trials.append(result)
        if result >= best_result:
            best_result = result
        else:
            selected_indexes.pop(-1)
    return [ordered[j] for j in selected_indexes], trials


def test_the_greedy_selection_is_diwas_restricted_rule_ties_included():
    rng = np.random.default_rng(0)
    cases = [
        # equal scores keep the listing order; an equal accuracy is accepted
        ([0.8, 0.9, 0.9, 0.7], {(1,): 0.5, (1, 2): 0.5, (1, 2, 0): 0.4, (1, 2, 3): 0.6}),
        # the first member is accepted whatever its accuracy; a drop is skipped
        ([0.5, 0.5, 0.5], {(0,): 0.0, (0, 1): -1.0, (0, 2): 0.0}),
    ]
    for _ in range(30):  # few distinct values: many ties of scores and of accuracies
        n = int(rng.integers(1, 7))
        cases.append((list(rng.choice([0.6, 0.7, 0.8], n)), None))
    for scores, table in cases:
        values = {}

        def accuracy(members, table=table, values=values):
            key = tuple(members)
            if table is not None:
                return table[key]
            return values.setdefault(key, float(rng.choice([0.5, 0.6, 0.7])))

        folders = {f"run{i}": s for i, s in enumerate(scores)}
        expected, trials = diwa_restricted(
            folders, lambda chosen: accuracy([int(f[3:]) for f in chosen]))
        lines = []
        chosen = soups.greedy_selection(scores, accuracy, lines.append)
        assert [f"run{i}" for i in chosen["accepted"]] == expected, (scores, values)
        assert chosen["accuracies"] == trials
        assert len(lines) == len(scores)
        assert all(("accepted" in line) == (i in chosen["accepted"])
                   for line, i in zip(lines, chosen["order"]))


def test_the_soups_label_names_the_averaging_and_the_members_method():
    made = []

    def member(algorithm="sagm", weights="best", **config):
        config = dict(algorithm=algorithm, objective="erm", disam_lambda=0.0, **config)
        record = {"args": {"algorithm": "x"}, "config": config}
        if weights == "swad":
            record["swad"] = {}
        made.append(f"/runs/run{len(made)}")
        return soups.Member(made[-1], weights, 0, "", 0.0, record, config, {}, {})

    assert soups.soup_label([member("erm"), member("erm")], "uniform") == "DiWA (uniform)"
    assert soups.soup_label([member()], "greedy") == "SAGM + DiWA (greedy)"
    assert soups.soup_label([member(weights="swad")], "uniform") == (
        "SAGM + SWAD + DiWA (uniform)")
    # Model Ratatouille: members started from auxiliary runs' featurizers, and (its
    # get_featurizer_aux's index 0) from the pretrained one.
    ratatouille = [member("erm", init_featurizer_from=""),
                   member("erm", init_featurizer_from="/aux/run0")]
    assert soups.soup_label(ratatouille, "greedy") == "Ratatouille (greedy)"


def _merged_out_accuracy(model, variables):
    """The soup's accuracy on the training environments' 'out' parts merged (diwa.py's
    MergeDataset of them): correct answers over examples, by a forward pass here."""
    from sagm_jax import data as data_lib

    dataset = data_lib.load("RotatedDigits", None, trial_seed=0, data_seed=0)
    apply = jax.jit(lambda v, x: model.apply(v, x, train=False))
    correct = total = 0
    for env in TRAIN_ENVS:
        k = dataset.splits[env]["out"]
        logits = apply(variables, np.asarray(dataset.source.images[env][k], np.float32))
        correct += int(np.sum(np.argmax(np.asarray(logits), -1) == dataset.source.labels[env][k]))
        total += len(k)
    return correct / total


@pytest.mark.slow
def test_the_greedy_soup_follows_the_rule_on_real_runs(members, tmp_path, capsys):
    out = str(tmp_path / "greedy")
    assert soups.main(["--out", out, "--selection", "greedy", *members]) == 0
    printed = capsys.readouterr().out
    decisions = [line for line in printed.splitlines() if line.startswith("greedy ")]
    assert len(decisions) == len(members) and "SAGM + DiWA (greedy)" in printed
    model, variables, record = loading.load_run(out)
    soup = record["soup"]
    scores = {f"run{i}": _selected(_records(w))[1] for i, w in enumerate(members)}
    tried, prefix = {}, ()  # the recorded accuracy of each candidate soup tried
    for decision in soup["decisions"]:
        candidate = prefix + (decision["member"],)
        tried[candidate] = decision["accuracy"]
        prefix = candidate if decision["accepted"] else prefix
    expected, _ = diwa_restricted(
        scores, lambda chosen: tried[tuple(int(f[3:]) for f in chosen)])
    assert [f"run{i}" for i in soup["accepted"]] == expected
    steps = [_selected(_records(w))[0]["step"] for w in members]
    _assert_params_equal(variables["params"], _float64_mean(
        [_checkpoint_params(members[i], steps[i]) for i in soup["accepted"]]))
    best = max(d["accuracy"] for d in soup["decisions"] if d["accepted"])
    assert _merged_out_accuracy(model, jax.device_get(variables)) == best
    last_accepted = [d for d in soup["decisions"] if d["accepted"]][-1]
    assert last_accepted["test"] == {"env0_in_acc": record["env0_in_acc"]}


@pytest.mark.slow
def test_members_that_differ_are_refused_naming_the_run(members, tmp_path):
    other_envs = copy_run_with(members[1], tmp_path / "test_envs", test_envs=[1])
    with pytest.raises(ValueError, match=rf"{other_envs} cannot join the runs of "
                       rf"{members[0]}: test_envs \[0\] -> \[1\]"):
        soups.members_of([members[0], other_envs], "best")
    other_data = copy_run_with(members[1], tmp_path / "dataset", dataset="RotatedMNIST")
    with pytest.raises(ValueError, match=rf"{other_data} cannot join.*dataset "
                       "'RotatedDigits' -> 'RotatedMNIST'"):
        soups.members_of([members[0], other_data], "last")
    other_split = copy_run_with(members[1], tmp_path / "split")
    with open(os.path.join(other_split, "split.json")) as f:
        split = json.load(f)
    split["trial_seed"] = 1
    rundir.write_json(os.path.join(other_split, "split.json"), split)
    with pytest.raises(ValueError, match=rf"{other_split} cannot join.*trial_seed 0 -> 1"):
        soups.members_of([members[0], other_split], "best")
    unfinished = copy_run_with(members[2], tmp_path / "unfinished")
    os.remove(os.path.join(unfinished, "done"))
    with pytest.raises(ValueError, match=rf"{unfinished}: not a finished run"):
        soups.members_of([members[0], unfinished], "best")
    combined = copy_run_with(members[2], tmp_path / "combined", combined_label="DiWA (uniform)")
    with pytest.raises(ValueError, match=rf"{combined}: a run combined from others"):
        soups.members_of([members[0], combined], "best")
    with pytest.raises(ValueError, match="listed twice"):
        soups.members_of([members[0], members[0]], "best")
    with pytest.raises(ValueError, match="did not train with --config.swad=True"):
        soups.members_of([members[0]], "swad")
    with pytest.raises(ValueError, match="did not train with --config.moving_average=True"):
        soups.members_of([members[0]], "moving_average")
    other_method = copy_run_with(members[1], tmp_path / "method", algorithm="erm")
    with pytest.raises(ValueError, match="the members train different methods"):
        soups.make_soup([members[0], other_method], str(tmp_path / "soup"))
    assert not os.path.exists(tmp_path / "soup")


@pytest.mark.slow
def test_a_soup_is_a_run_of_its_row_in_collect_results(members, tmp_path):
    root = tmp_path / "sweep"
    for k, workdir in enumerate(members):
        shutil.copytree(workdir, root / f"member{k}")
    copies = [str(root / f"member{k}") for k in range(len(members))]
    record = soups.make_soup(copies, str(root / "soup"), "uniform", "last")
    with pytest.raises(ValueError, match="already holds a finished run"):
        soups.make_soup(copies, str(root / "soup"), "uniform", "last")
    found = {os.path.basename(r.path): r for r in rundir.find_runs(str(root))}
    assert found["soup"].done and found["soup"].records == [record]
    loaded = records_lib.load_sweep(str(root))
    assert not loaded.left_out and len(loaded.finished) == 4
    rows = {group[2] for group in loaded.groups}
    assert rows == {"SAGM", "SAGM + DiWA (uniform)"}
    (soup_group,) = [g for g in loaded.groups if g[2] == "SAGM + DiWA (uniform)"]
    assert loaded.where[soup_group, records_lib.setting_key(record), (0,)] == "soup"
    # The last weights: each member's last checkpoint, step 4.
    assert [m["step"] for m in record["soup"]["members"]] == [4, 4, 4]
    _, variables, _ = loading.load_run(str(root / "soup"), "latest")
    _assert_params_equal(variables["params"],
                         _float64_mean([_checkpoint_params(w, 4) for w in members]))


def _with_statistics(workdir, folder, value, **config):
    """A copy of ``workdir`` whose last checkpoint (step 4) holds BatchNorm statistics
    ``value`` beside its parameters."""
    from sagm_jax.training import checkpoints

    copy = copy_run_with(workdir, folder, **config)
    params = _checkpoint_params(workdir, 4)
    shutil.rmtree(os.path.join(copy, "checkpoints"))
    stats = {"bn": {"mean": np.full(3, value, np.float32), "var": np.ones(3, np.float32)}}
    saved = checkpoints.Checkpoints(copy)
    saved.save(4, {"params": jax.tree.map(np.float32, params), "batch_stats": stats}, 0.5)
    return copy


@pytest.mark.slow
def test_frozen_batchnorm_statistics_must_be_the_members_own_shared_ones(members, tmp_path):
    same = [_with_statistics(members[k], tmp_path / f"same{k}", 1.0) for k in (0, 1)]
    soup = soups.uniform_soup(soups.members_of(same, "last"))
    np.testing.assert_array_equal(soup["batch_stats"]["bn"]["mean"], np.ones(3))
    expected = _float64_mean([_checkpoint_params(w, 4) for w in members[:2]])
    _assert_params_equal(soup["params"], expected)
    other = _with_statistics(members[2], tmp_path / "other", 2.0)
    with pytest.raises(ValueError, match=rf"{other}: its frozen BatchNorm statistics differ "
                       rf"from those of {same[0]}"):
        soups.uniform_soup(soups.members_of([*same, other], "last"))
    # Trainable BatchNorm: the statistics are re-estimated for the soup (by its
    # evaluation, as SWAD's), so members may differ; the first's are kept until then.
    trained = [_with_statistics(members[k], tmp_path / f"trained{k}", float(k),
                                freeze_batchnorm=False) for k in (0, 1)]
    soup = soups.uniform_soup(soups.members_of(trained, "last"))
    np.testing.assert_array_equal(soup["batch_stats"]["bn"]["mean"], np.zeros(3))
    # A member whose weights change after they were read (hashed) is refused.
    changing = _with_statistics(members[1], tmp_path / "changing", 1.0)
    read = soups.members_of([same[0], changing], "last")
    changed = _with_statistics(members[1], tmp_path / "changed", 3.0)
    shutil.rmtree(os.path.join(changing, "checkpoints"))
    shutil.copytree(os.path.join(changed, "checkpoints"), os.path.join(changing, "checkpoints"))
    with pytest.raises(ValueError, match=rf"{changing}: its last weights \(step 4\) changed"):
        soups.uniform_soup(read)
