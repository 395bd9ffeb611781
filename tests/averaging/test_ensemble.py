"""EoA's ensemble (sagm_jax.averaging.ensemble): the combination against a NumPy
re-statement of salesforce/ensemble-of-averages domainbed/EoA.py ``accuracy`` (the sum
of the members' logits, torch's argmax: the first largest class on a tie) on given
logits; two tiny moving-average runs ensembled: each member's accuracies are its own
records', the ensemble's are the argmax of its members' summed logits computed here
with ``model.apply``; members that differ are refused, naming the run."""

import json
import os

import jax
import numpy as np
import pytest
from run_fixtures import copy_run_with, digits_config

from sagm_jax.averaging import ensemble
from sagm_jax.training import loading, packed, rundir


def _reference_accuracy(logits, labels):
    """EoA.py ``accuracy`` on one loader: ``p = p_1; p += p_i`` (float64 here: the test's
    logits are multiples of 1/4, whose sums are exact in float32 too), then
    ``p.argmax(1).eq(y)`` summed over ``len(x)``; the argmax is the first maximal
    index, written out as a loop."""
    p = np.zeros_like(np.asarray(logits[0], np.float64))
    for member in logits:
        p = p + np.asarray(member, np.float64)
    predictions = []
    for row in p:
        best = 0
        for c in range(1, len(row)):
            if row[c] > row[best]:
                best = c
        predictions.append(best)
    return np.asarray(predictions), float(np.mean(np.asarray(predictions) == labels))


def test_the_prediction_is_the_sum_of_the_members_logits_first_max_on_a_tie():
    rng = np.random.default_rng(0)
    logits = [rng.integers(-8, 9, size=(40, 5)) / 4.0 for _ in range(3)]
    # Ties built in: rows whose sums tie between classes (1, 3), (0, 4) and all five.
    logits[0][0], logits[1][0], logits[2][0] = [0, 1, 0, 0.5, 0], [0, 0, 0, 0.5, 0], [0, 0, 0, 0, 0]
    logits[0][1], logits[1][1], logits[2][1] = [1, 0, 0, 0, 0.5], [0, 0, 0, 0, 0.5], [0] * 5
    for member in logits:
        member[2] = 0.25
    labels = rng.integers(0, 5, size=40)
    want, accuracy = _reference_accuracy(logits, labels)
    assert want[0] == 1 and want[1] == 0 and want[2] == 0
    np.testing.assert_array_equal(ensemble.ensemble_prediction(logits), want)
    sums = ensemble.LogitSums()
    for k, member in enumerate(logits):
        sums.add({(0, "in"): (member.astype(np.float32), labels)}, f"member {k}")
    assert sums.results()["env0_in_acc"] == accuracy
    assert sums.member_accuracies[1]["env0_in_acc"] == _reference_accuracy([logits[1]], labels)[1]


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """Two finished RotatedDigits ERM runs (learning rates 1e-3 and 3e-3; one seed: the
    digits' rotations, and so the split, follow it) predicting with their moving
    averages from update 2, trained as one pack."""
    root = tmp_path_factory.mktemp("eoa")
    configs = [digits_config(moving_average=True, moving_average_start=2, lr=lr,
                             algorithm="erm")
               for lr in (1e-3, 3e-3)]
    dirs = [str(root / f"run{r}") for r in (0, 1)]
    packed.train_pack(configs, dirs)
    return root, dirs


def _apply_logits(workdir, step, images):
    model, variables, _ = loading.load_run(workdir, step)
    return np.asarray(model.apply(jax.device_get(variables), images, train=False), np.float32)


@pytest.mark.slow
def test_the_ensemble_of_two_runs_is_written_as_a_run_and_printed(members, capsys):
    from sagm_jax import data as data_lib
    from sagm_jax.results.records import method_name

    root, dirs = members
    out = str(root / "eoa")
    assert ensemble.main(["--out", out, *dirs]) == 0
    printed = capsys.readouterr().out
    (record,) = rundir.read_records(out)
    assert record["algorithm"] == "EoA" == method_name(record)
    assert "EoA of 2: test env0" in printed and all(d in printed for d in dirs)
    # Each member's accuracies, from the ensemble's own pass over the data, are those
    # its run recorded at the chosen step (the run's evaluator's).
    steps = []
    for member, workdir in zip(record["ensemble"]["members"], dirs):
        own = next(r for r in rundir.read_records(workdir) if r["step"] == member["step"])
        assert member["path"] == os.path.abspath(workdir)
        for key, value in member["accuracies"].items():
            if key in own:
                assert value == own[key], (workdir, key)
        steps.append(member["step"])
    # The ensemble's accuracy on environment 0's 'in' part: the argmax of the sum of the
    # members' logits, each computed here with model.apply on the part's images.
    dataset = data_lib.load("RotatedDigits", None, trial_seed=0, data_seed=0)
    batches = list(dataset.eval_iterator(0, "in", batch_size=1000))
    images = np.concatenate([np.asarray(b["image"])[np.asarray(b["mask"], bool)] for b in batches])
    labels = np.concatenate([np.asarray(b["label"])[np.asarray(b["mask"], bool)] for b in batches])
    logits = [_apply_logits(d, s, images) for d, s in zip(dirs, steps)]
    _, accuracy = _reference_accuracy(logits, labels)
    assert abs(record["env0_in_acc"] - accuracy) <= 1 / len(labels)
    whole = record["ensemble"]["whole_env_acc"]["0"]
    n_in, n_out = len(dataset.splits[0]["in"]), len(dataset.splits[0]["out"])
    assert whole == pytest.approx(
        (record["env0_in_acc"] * n_in + record["env0_out_acc"] * n_out) / (n_in + n_out))
    assert len(record["ensemble"]["members"]) == 2
    with open(os.path.join(out, rundir.RUN_INFO)) as f:
        assert [m["path"] for m in json.load(f)["members"]] == [os.path.abspath(d) for d in dirs]


@pytest.mark.slow
@pytest.mark.parametrize("change, words", [
    ({"test_envs": [1]}, ["test_envs [0] -> [1]"]),
    ({"moving_average": False}, ["--config.moving_average=True"]),
])
def test_members_that_differ_are_refused_naming_the_run(members, tmp_path, change, words):
    _, dirs = members
    other = copy_run_with(dirs[1], tmp_path / "other", **change)
    with pytest.raises(ValueError) as error:
        ensemble.make_ensemble([dirs[0], other], str(tmp_path / "eoa"))
    assert other in str(error.value) and all(w in str(error.value) for w in words), error.value
    assert not os.path.exists(tmp_path / "eoa")
