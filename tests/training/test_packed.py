"""Packed runs (sagm_jax.training.packed) against the same runs trained alone."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sagm_jax.training import checkpoints as checkpoints_lib
from sagm_jax.training import packed, train
from sagm_jax.training.rundir import read_records
from sagm_jax.training.train_step import data_parallel_train_step

from run_fixtures import digits_config

ONE_DEVICE = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))


def _configs(runs, **shared):
    """Run r of ``runs``: its own (test environment, trial seed, seed, lr, ...)."""
    configs = []
    for overrides in runs:
        config = digits_config(**shared)
        config.update(overrides)
        configs.append(config)
    return configs


def _separate_steps(config, steps):
    """``steps`` updates of the run alone, as ``train.setup`` builds it (one device)."""
    program, variables = train.open_run(config, ONE_DEVICE)
    variables = jax.device_get(variables)  # a host copy: the step donates the state's arrays
    n = len(program.train_envs)
    optimizer = train.optimizer_from_config(config, num_domains=n)
    state = jax.device_put(
        train.initial_state(config, variables, optimizer, n), NamedSharding(ONE_DEVICE, P())
    )
    step = data_parallel_train_step(config, program.model, optimizer, ONE_DEVICE, n)
    key = jax.random.split(jax.random.key(config.seed))[1]
    batches = program.dataset.train_iterator(
        program.train_envs, seed=config.seed, batch_per_env=config.batch_per_env
    )
    initial = jax.device_get(state)
    for _ in range(steps):
        state, _ = step(state, next(batches), key)
    return program, variables, initial, jax.device_get(state)


def _packed_steps(configs, programs, variables, steps):
    values = packed.varying_values(configs)
    n = len(programs[0].train_envs)
    states = packed.packed_initial_states(configs[0], values, variables, n)
    step = packed.packed_train_step(configs[0], programs[0].model, n)
    keys = jnp.stack([jax.random.split(jax.random.key(c.seed))[1] for c in configs])
    iterators = [
        p.dataset.train_iterator(p.train_envs, seed=c.seed, batch_per_env=c.batch_per_env)
        for c, p in zip(configs, programs)
    ]
    active = jnp.ones(len(configs), bool)
    for _ in range(steps):
        batches = [next(it) for it in iterators]
        stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        states, _ = step(values, states, stacked, keys, active)
    return jax.device_get(states)


# Per method kind: the runs' own values, and the largest difference measured between a
# packed step and the run's own (relative to the parameter's largest change).
KINDS = {
    # plain: ERM's update with IRM's loss (its anneal length, an integer, and the
    # network's dropout traced: TracedDropout, rate 0 in one run)
    "irm-dropout": (
        dict(objective="irm", algorithm="erm"),
        [
            dict(irm_penalty_anneal_iters=1, dropout=0.0),
            dict(irm_penalty_anneal_iters=2, dropout=0.3, lr=3e-3, seed=1, test_envs=(2,)),
        ],
    ),
    "sagm": (
        dict(algorithm="sagm"),
        [dict(lr=1e-3, rho=0.05, alpha=1e-3), dict(lr=2e-3, rho=0.1, alpha=5e-4, trial_seed=1)],
    ),
    "groupdro": (
        dict(objective="groupdro", algorithm="sam"),
        [dict(groupdro_eta=1e-2), dict(groupdro_eta=1e-1, seed=2, test_envs=(3,))],
    ),
    "dann": (
        dict(algorithm="dann"),
        [dict(lr_d=1e-3, d_steps_per_g_step=1), dict(lr_d=3e-3, d_steps_per_g_step=2, seed=1)],
    ),
    "mixup-swad": (
        dict(objective="mixup", algorithm="gsam", swad=True),
        [dict(mixup_alpha=0.2), dict(mixup_alpha=0.3, weight_decay=1e-4, seed=1)],
    ),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_step_is_each_runs_own_step(kind):
    """One update of a pack of two runs that differ in seed, split or test environment and
    in their hyperparameters, against each run's own jitted step, on every leaf of the
    train state (parameters, optimizer, objective and SWAD state). The pack's program
    vectorises the convolutions, so their sums run in another order.

    * Every leaf but the weights (Adam's moments: the gradients) agrees to rounding: all
      together, as one vector, within 1e-4 of their change in the L2 norm (single
      early-layer elements, sums of 31,000 terms that cancel, differ more). Measured
      (2-core CPU, ``-s``): IRM + dropout under ERM 4e-8, DANN 3e-7, SAGM and GroupDRO +
      SAM 3e-5, Mixup + GSAM + SWAD 4e-5.
    * A weight element agrees within 2e-3 of its leaf's change, or differs by Adam's sign
      flip: where the step's direction ``d`` cancels to rounding level (the early layers
      of this tiny network at initialisation have gradients ~1e-6), Adam's first step
      ``lr d / |d|`` takes either sign, so the two runs move it by +lr or -lr. Measured:
      at most 9 of 26,000 weights (SAGM), at most 1% of a leaf allowed."""
    shared, runs = KINDS[kind]
    configs = _configs(runs, **shared)
    separate = [_separate_steps(c, 1) for c in configs]
    programs, variables = [s[0] for s in separate], [s[1] for s in separate]
    states = _packed_steps(configs, programs, variables, 1)
    largest_lr = max(max(c.lr, c.lr_d, c.lr_g) for c in configs)
    worst, worst_weight, outliers = 0.0, 0.0, 0
    state_error, state_change = [], []
    for r, (_, _, initial, alone) in enumerate(separate):
        lane = jax.tree.map(lambda x, r=r: x[r], states)
        for (path, got), want, start in zip(
            jax.tree_util.tree_leaves_with_path(lane),
            jax.tree.leaves(alone),
            jax.tree.leaves(initial),
            strict=True,
        ):
            keystr = jax.tree_util.keystr(path)
            where = (kind, r, keystr)
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            change = np.abs(want - np.asarray(start, np.float64)).max(initial=0.0)
            error = np.abs(got - want)
            if change == 0:  # a leaf the step leaves alone stays exactly
                assert error.max(initial=0.0) == 0, where
                continue
            weights = keystr.startswith((".params", ".averages"))
            if not weights:  # the state's whole vector, below
                state_error.append(got - want)
                state_change.append(want - np.asarray(start, np.float64))
                continue
            flipped = error > 2e-3 * change
            assert error.max() <= 2.01 * largest_lr and flipped.mean() <= 0.01, where
            outliers += int(flipped.sum())
            kept = float(np.max(error, where=~flipped, initial=0))
            worst_weight = max(worst_weight, kept / change)
    # The optimizer's and objective's state as one vector (Adam's moments: the gradient),
    # relative to its change in the L2 norm.
    def flat(parts):
        return np.concatenate([p.ravel() for p in parts])

    worst = np.linalg.norm(flat(state_error)) / np.linalg.norm(flat(state_change))
    assert worst <= 1e-4, (kind, worst)
    print(f"{kind}: optimizer and objective state within {worst:.1e} (L2, of the change); "
          f"{outliers} weights flipped, the others within {worst_weight:.1e} of their leaf's "
          "change")


def _records(workdir):
    return [{k: v for k, v in r.items() if k.endswith(("_acc", "_loss")) or k in ("step", "loss")}
            for r in read_records(workdir)]


# Packed runs and runs alone (or a pack on 8 devices and on 1) compute their convolutions'
# sums in other orders (module docstring of sagm_jax.training.packed), and Adam's first
# steps turn rounding-level directions into +-lr (test_a_packed_step_is_each_runs_own_step):
# a few-step run near chance then moves a prediction or two. RotatedDigits' evaluated parts
# hold at least 59 digits, so two predictions are at most 0.034 of an accuracy.
TWO_PREDICTIONS, LOSS_RTOL = 0.034, 1e-3


def assert_records_agree(got_dir, want_dir, label):
    """The same steps and keys; accuracies within two predictions, losses within 1e-3;
    returns the largest accuracy and loss differences."""
    got, want = _records(got_dir), _records(want_dir)
    assert [g["step"] for g in got] == [w["step"] for w in want], label
    largest = {"acc": 0.0, "loss": 0.0}
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), label
        for key in g:
            if key.endswith("_acc"):
                assert abs(g[key] - w[key]) <= TWO_PREDICTIONS, (label, g["step"], key)
                largest["acc"] = max(largest["acc"], abs(g[key] - w[key]))
            elif key != "step":
                assert g[key] == pytest.approx(w[key], rel=LOSS_RTOL), (label, g["step"], key)
                largest["loss"] = max(largest["loss"], abs(g[key] / w[key] - 1))
    return largest


def _params(workdir, step):
    return jax.tree.leaves(checkpoints_lib.restore_variables(str(workdir), step))


def test_a_pack_of_one_is_the_run_trained_alone(tmp_path):
    """R = 1: the same records, accuracies and losses, bit for bit, and the same final
    parameters in the checkpoint."""
    (config,) = _configs([dict(algorithm="sagm")])
    train.train_one_run(config, str(tmp_path / "alone"))
    packed.train_pack([config], [str(tmp_path / "packed")])
    assert _records(tmp_path / "packed") == _records(tmp_path / "alone")
    last = read_records(tmp_path / "alone")[-1]["step"]
    for got, want in zip(
        _params(tmp_path / "packed", last), _params(tmp_path / "alone", last), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    assert os.path.exists(tmp_path / "packed" / "done")


def test_vmapped_runs_record_what_the_runs_alone_record(tmp_path):
    """Two runs (two test environments, trial seeds, seeds, learning rates) packed
    with vmapped lanes (the default on several accelerators; the loop lanes are checked by
    tests/sweep/test_packs.py) against each alone: records that agree
    (:func:`assert_records_agree`; measured on the 2-core CPU: the same accuracies,
    losses within 2e-6)."""
    configs = _configs(
        [dict(lr=1e-3), dict(lr=3e-3, test_envs=(1,), seed=1, trial_seed=1)],
        algorithm="sagm", steps=5,
    )
    dirs = [str(tmp_path / f"pack{r}") for r in range(2)]
    packed.train_pack(configs, dirs, lanes="vmap")
    for r, config in enumerate(configs):
        train.train_one_run(config, str(tmp_path / f"alone{r}"))
        largest = assert_records_agree(dirs[r], tmp_path / f"alone{r}", r)
        print(f"run {r}: largest differences {largest}")
        with open(os.path.join(dirs[r], "config.json")) as f:
            assert json.load(f)["lr"] == config.lr


@pytest.mark.parametrize("lanes", packed.LANES)
def test_a_pack_stopped_between_two_runs_saves_resumes_bit_for_bit(tmp_path, monkeypatch, lanes):
    """Stopped after the first run saved step 2 and before the second did, the first
    run's last record line torn: the relaunched pack makes that record again from its
    checkpoint, resumes the runs at steps 3 and 1, and every record and final parameter
    is the uninterrupted pack's, bit for bit."""
    configs = _configs([dict(lr=1e-3), dict(lr=2e-3, test_envs=(1,), seed=1)], algorithm="sagm")
    reference = [str(tmp_path / f"reference{r}") for r in range(2)]
    packed.train_pack(configs, reference, lanes=lanes)
    dirs = [str(tmp_path / f"resumed{r}") for r in range(2)]
    save = checkpoints_lib.Checkpoints.save

    def stop_at_second_runs_step_2(self, step, *args, **kwargs):
        if step == 2 and self.directory == os.path.join(dirs[1], "checkpoints"):
            raise KeyboardInterrupt
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoints_lib.Checkpoints, "save", stop_at_second_runs_step_2)
    with pytest.raises(KeyboardInterrupt):
        packed.train_pack(configs, dirs, lanes=lanes)
    monkeypatch.setattr(checkpoints_lib.Checkpoints, "save", save)
    assert [r["step"] for r in read_records(dirs[0])] == [0, 2]
    results = os.path.join(dirs[0], "results.jsonl")  # and the first run's last line torn
    with open(results, "rb+") as f:
        f.truncate(os.path.getsize(results) - 40)
    packed.train_pack(configs, dirs, lanes=lanes)
    for r in range(2):
        assert _records(dirs[r]) == _records(reference[r])
        last = read_records(reference[r])[-1]["step"]
        for got, want in zip(_params(dirs[r], last), _params(reference[r], last), strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_pack_sharded_over_devices_is_the_pack_on_one(tmp_path):
    """Two runs in vmapped lanes, the run axis sharded over two of the fake devices (one
    run each, as eight runs on eight), against the same pack on one device
    (``num_devices=1``): records that agree (:func:`assert_records_agree`)."""
    runs = [dict(seed=r, lr=1e-3 * (1 + r / 2), test_envs=(r,)) for r in range(2)]
    spread = _configs(runs, algorithm="sagm", steps=3, num_devices=2)
    one = _configs(runs, algorithm="sagm", steps=3, num_devices=1)
    assert packed.pack_mesh(2, 2).devices.size == 2 and packed.pack_mesh(2, 1).devices.size == 1
    assert packed.pack_mesh(8, 0).devices.size == 8 and packed.pack_mesh(3, 0).devices.size == 1
    packed.train_pack(spread, [str(tmp_path / f"spread{r}") for r in range(2)], lanes="vmap")
    packed.train_pack(one, [str(tmp_path / f"one{r}") for r in range(2)], lanes="vmap")
    for r in range(2):
        largest = assert_records_agree(tmp_path / f"spread{r}", tmp_path / f"one{r}", r)
        print(f"run {r}: largest differences {largest}")


def test_runs_that_cannot_share_a_program_are_refused_with_what_differs(tmp_path):
    configs = _configs([dict(algorithm="sagm"), dict(algorithm="erm", batch_per_env=4)])
    with pytest.raises(ValueError) as error:
        packed.train_pack(configs, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert "config.algorithm differs" in str(error.value)
    assert "config.batch_per_env differs" in str(error.value)
    assert not os.path.exists(tmp_path / "a")
