"""Every method of sagm_jax.methods trains end to end (sagm_jax.training.train), on MNIST-like
data and an image folder, on 8 fake devices as on 1, and resumes exactly."""

import jax
import numpy as np
import pytest

from sagm_jax import methods
from sagm_jax.training import loading
from sagm_jax.training import train

from run_fixtures import digits_config

# One end-to-end run per kind of method; the unit tests (tests/methods/test_objectives.py,
# test_procedures.py, tests/training/test_train_step.py) check each method's step. Here:
# an objective whose anneal switches and restarts Adam inside the run, under a head (whose
# second pass needs the objective's gradient at the perturbed point), and an objective
# with random draws under DISAM on GSAM; below, a feature penalty (CORAL + SAGM + DISAM)
# and a whole-batch procedure with its own module (SagNet) on 1 and 8 devices (the
# record's loss and accuracies, the weights); GroupDRO, IRM, DANN and SAGM + MIRO + SWAD
# resumed; CutMix and a whole-batch procedure on an image folder. ERM, SAM and a
# per-domain procedure also train in tests/test_extending.py, plain SAGM in
# tests/training/test_train.py, each method once in its own test file.
COMBINATIONS = [
    dict(objective="irm", algorithm="sagm"),
    dict(objective="mixup", algorithm="gsam", disam_lambda=0.5),
]
# Small anneals, so that IRM's and VREx's switch and Adam restart happen inside a test.
SHORT = dict(irm_penalty_anneal_iters=2, vrex_penalty_anneal_iters=2, mldg_n_meta_test=1)


def _params(workdir):
    return jax.tree.leaves(loading.load_run(str(workdir), "latest")[1]["params"])


@pytest.mark.slow
@pytest.mark.parametrize("method", COMBINATIONS, ids=lambda m: "-".join(map(str, m.values())))
def test_every_method_trains_end_to_end(tmp_path, method):
    records = train.train_and_evaluate(
        digits_config(steps=2, eval_every=1, **SHORT, **method), str(tmp_path)
    )
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r["loss"]) for r in records)
    objective = method.get("objective", "erm")
    # DomainBed's reported values: CORAL/MMD the loss without the penalty, and the penalty.
    expected = {"coral": {"penalty"}, "mmd": {"penalty"}, "irm": {"nll", "penalty"},
                "vrex": {"nll", "penalty"}}.get(objective, set())
    if method["algorithm"] in methods.rule_names("procedure"):
        expected = set()
    assert {"penalty", "nll"} & set(records[0]) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [dict(objective="coral", algorithm="sagm", disam_lambda=0.5), dict(algorithm="sagnet")],
    ids=lambda m: "-".join(map(str, m.values())),
)
def test_a_method_on_eight_devices_is_the_one_device_run(tmp_path, method):
    config = dict(SHORT, steps=2, eval_every=1, **method)
    eight = train.train_and_evaluate(digits_config(num_devices=0, **config),
                                     str(tmp_path / "eight"))
    one = train.train_and_evaluate(digits_config(num_devices=1, **config), str(tmp_path / "one"))
    for a, b in zip(one, eight):
        for key in ("loss", "penalty"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6)
        for key in (k for k in a if k.endswith("_acc")):
            assert a[key] == pytest.approx(b[key], abs=1.0 / 60), key  # one example at most
    # Per-domain statistics over the global batch: the 8-device run is the 1-device run
    # up to float32 sums in another order (a per-shard statistic moves most weights).
    flat = [np.concatenate([np.ravel(p) for p in _params(tmp_path / w)]) for w in ("one", "eight")]
    assert np.isclose(flat[0], flat[1], rtol=1e-3, atol=1e-5).mean() > 0.999


class Killed(Exception):
    """Stands for a SIGKILL in the middle of a run (tests/training/test_train.py kills for real)."""


def _stop_before(step_to_stop, monkeypatch):
    build = train.data_parallel_train_step

    def interrupted(*args, **kwargs):
        step_fn = build(*args, **kwargs)

        def step(state, batch, key):
            if int(state.step) == step_to_stop:
                raise Killed(step_to_stop)
            return step_fn(state, batch, key)

        return step

    monkeypatch.setattr(train, "data_parallel_train_step", interrupted)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        # The state beyond the optimizer's: GroupDRO's q (under a head, with DISAM and
        # Mixup's draws), IRM's Adam restart on the first step after the resume, the
        # alternation of two Adams (DANN's, by the step counter) over the network and its
        # own discriminator. Random draws (Mixup's, MLDG's permutation) are functions
        # of (seed, step), as dropout's, which tests/training/test_train.py resumes.
        dict(objective="groupdro", algorithm="sagm", disam_lambda=0.5),
        dict(objective="irm", algorithm="erm", irm_penalty_anneal_iters=3),
        dict(algorithm="dann"),
        # TRM end to end: its heads (params["method"]) and domain weights (its optimizer
        # state), moving from step 1 on; RDM's penalty switch and Adam restart at rdm_lr
        # after the resume. (A method's state in batch_stats, Fishr's moving average,
        # resumes as MIRO's oracle below.)
        dict(algorithm="trm", trm_iters=1),
        dict(objective="rdm", algorithm="erm", rdm_penalty_anneal_iters=3),
        # SAGM + MIRO with SWAD: its encoders, its frozen oracle (in batch_stats), SWAD's
        # weight averages and the loss valley's state resume too (tolerance 100: the
        # valley lives on to the end, whose average is recorded).
        dict(objective="miro", algorithm="sagm", swad=True, steps=9, swad_eval_every=2,
             swad_n_converge=2, swad_n_tolerance=3, swad_tolerance_ratio=100.0),
    ],
    ids=lambda m: "-".join(map(str, m.values()))[:40],
)
def test_a_stateful_method_resumes_exactly(tmp_path, monkeypatch, method):
    # One device: the state's checkpoint and restore do not depend on the devices
    # (test_a_method_on_eight_devices_is_the_one_device_run shards the methods).
    config = digits_config(**{"steps": 5, "eval_every": 2, **method})
    whole = train.train_and_evaluate(config, str(tmp_path / "whole"))  # records 0, 2, 4, ...
    with monkeypatch.context() as patch:
        _stop_before(3, patch)  # after the checkpoint of step 2
        with pytest.raises(Killed):
            train.train_and_evaluate(config, str(tmp_path / "killed"))
    train.train_and_evaluate(config, str(tmp_path / "killed"))
    resumed = train.read_records(str(tmp_path / "killed"))
    assert len(resumed) == len(whole) >= 3
    for again, first in zip(resumed, train.read_records(str(tmp_path / "whole"))):
        differ = {k for k in first if k != "args" and again.get(k) != first[k]}
        assert not differ, (first["step"], differ)
    for a, b in zip(_params(tmp_path / "whole"), _params(tmp_path / "killed")):
        np.testing.assert_array_equal(a, b)
    if config.swad:
        swad_whole, swad_killed = (loading.load_run(str(tmp_path / w), "swad")
                                   for w in ("whole", "killed"))
        for a, b in zip(jax.tree.leaves(swad_whole[1]), jax.tree.leaves(swad_killed[1])):
            np.testing.assert_array_equal(a, b)
        drop_args = lambda record: {k: v for k, v in record.items() if k != "args"}  # noqa: E731
        assert drop_args(swad_whole[2]) == drop_args(swad_killed[2])


@pytest.mark.slow
@pytest.mark.parametrize("method", [dict(objective="cutmix", algorithm="sagm", disam_lambda=0.5),
                                    dict(algorithm="dann")], ids=("cutmix", "dann"))
def test_a_method_trains_on_an_image_folder_through_the_device_input(tmp_path, method):
    """CutMix (an objective that cuts boxes out of the augmented images) under DISAM on
    SAGM, and DANN (a whole-batch procedure with a module of its own). The per-domain
    procedures (Fish, AND-mask, MLDG) read any batch alike: a new one trains end to end
    in tests/test_extending.py, and each one's update is checked step by step in
    tests/methods/test_procedures.py."""
    from run_fixtures import tiny_folder_config, write_image_tree

    write_image_tree(tmp_path / "data", n=4)
    config = tiny_folder_config(
        tmp_path, steps=2, eval_every=1, test_envs=(1,), cache_dir=str(tmp_path / "cache"),
        **method,
    )
    records = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r["loss"]) for r in records)
    assert records[0]["config"]["objective"] == method.get("objective", "erm")
    if method.get("algorithm") == "dann":  # a generator step, then a discriminator step:
        # each record averages the loss its steps computed (DomainBed's per-key means)
        assert {"gen_loss"} <= set(records[0]) and "disc_loss" not in records[0]
        assert {"disc_loss"} <= set(records[1]) and "gen_loss" not in records[1]
        assert records[0]["loss"] == records[0]["gen_loss"]
        _, variables, _ = loading.load_run(str(tmp_path / "run"), "latest")
        assert set(variables["params"]["method"]) == {"discriminator"}
