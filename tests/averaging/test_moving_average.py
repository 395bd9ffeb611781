"""A run's moving average of its weights (sagm_jax.averaging.moving_average): the rule
against a float64 re-statement of the references' ``update_sma``
(salesforce/ensemble-of-averages domainbed/algorithms.py ``MovingAvg``; DomainBed
domainbed/lib/misc.py ``ErmPlusPlusMovingAvg``) and of ERM++'s BatchNorm forward
(DomainBed domainbed/algorithms.py ``ERMPlusPlus.update``); a tiny RotatedDigits run
that predicts with its average (records, load_run, kill and resume, a pack)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import assert_the_evaluation_reproduces_the_record, digits_config, record_params

from sagm_jax.averaging import moving_average
from sagm_jax.config import config_problems
from sagm_jax.training import loading, packed, rundir, train
from sagm_jax.training.checkpoints import restore_variables, saved_steps
from sagm_jax.training.train_step import apply_model


def _weights(k, rng):
    """The weights after update ``k`` (``k`` 0: the initial ones): random trees with
    BatchNorm statistics, as float32."""
    del k
    return {
        "params": {"dense": {"kernel": rng.normal(size=(3, 2)), "bias": rng.normal(size=2)}},
        "batch_stats": {"bn": {"mean": rng.normal(size=2), "var": rng.uniform(0.5, 2, 2)}},
    }


def _update_sma(weights, start):
    """The references' ``update_sma`` in float64, the averaged model starting as a copy
    of the network (``copy.deepcopy``): after each update ``global_iter += 1``; from
    ``sma_start_iter`` on ``sma_count += 1`` and ``(avg * sma_count + w) / (1 + sma_count)``,
    before it a copy of ``w``; every entry of the state dict (statistics too)."""
    flat = [jax.tree.leaves(w) for w in weights]
    average, count, history = [np.array(x, np.float64) for x in flat[0]], 0, []
    for k in range(1, len(weights)):
        if k >= start:
            count += 1
            average = [(a * count + np.float64(w)) / (1.0 + count)
                       for a, w in zip(average, flat[k])]
        else:
            average = [np.array(w, np.float64) for w in flat[k]]
        history.append((average, count))
    return history


@pytest.mark.parametrize("start", [1, 3])
def test_the_average_is_update_smas_on_a_sequence_of_weights(start):
    rng = np.random.default_rng(start)
    weights = [jax.tree.map(lambda x: np.asarray(x, np.float32), _weights(k, rng))
               for k in range(7)]
    step = jax.jit(moving_average.update, static_argnums=4)
    average = moving_average.init_moving_average(weights[0])
    for k, (want, count) in enumerate(_update_sma(weights, start), start=1):
        average = step(average, weights[k]["params"], weights[k]["batch_stats"],
                       jnp.int32(k), start)
        got = jax.tree.leaves({"batch_stats": average.batch_stats, "params": average.params})
        assert int(average.count) == count
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-6, atol=1e-6)
        # The closed form the module states: the mean of the weights after updates
        # start - 1 .. k (a copy of w_k before the start).
        first = start - 1 if k >= start else k
        mean = [np.mean([np.float64(jax.tree.leaves(w)[i]) for w in weights[first:k + 1]], 0)
                for i in range(len(want))]
        for g, m in zip(got, mean):
            np.testing.assert_allclose(np.asarray(g, np.float64), m, rtol=1e-6, atol=1e-6)


class _TinyBatchNormNet(nn.Module):
    """Dense(3), BatchNorm (momentum 0.9: torch's 0.1), Dense(2)."""

    @nn.compact
    def __call__(self, x, train=False, mixstyle=False):
        del mixstyle
        h = nn.Dense(3, name="dense")(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(h)
        return nn.Dense(2, name="head")(h)


def test_erm_plus_plus_forward_moves_the_averages_statistics_toward_the_batch():
    """ERMPlusPlus.update: ``update_sma()`` then ``network_sma.train(); network_sma(all_x)``:
    the averaged statistics become ``0.9 s + 0.1 batch``, the batch's mean and (biased,
    Flax's) variance of the BatchNorm input computed here with the averaged weights."""
    model = _TinyBatchNormNet()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    variables = jax.device_get(model.init(jax.random.key(0), x))
    weights = [jax.tree.map(lambda v: np.asarray(v + rng.normal(size=v.shape) * 0.1, np.float32),
                            variables) for _ in range(4)]
    average = moving_average.init_moving_average(weights[0])
    kernel64, bias64 = None, None
    for k in (1, 2, 3):
        average = moving_average.update(average, weights[k]["params"],
                                        weights[k]["batch_stats"], jnp.int32(k), 2)
        before = jax.device_get(average)
        average = moving_average.batchnorm_forward(average, model, jnp.asarray(x), jnp.float32,
                                                   jax.random.key(k), apply_model=apply_model)
        kernel64 = np.float64(before.params["dense"]["kernel"])
        bias64 = np.float64(before.params["dense"]["bias"])
        h = np.float64(x) @ kernel64 + bias64
        for name, batch in (("mean", h.mean(0)), ("var", h.var(0))):
            want = 0.9 * np.float64(before.batch_stats["bn"][name]) + 0.1 * batch
            np.testing.assert_allclose(np.asarray(average.batch_stats["bn"][name]), want,
                                       rtol=1e-5, atol=1e-6)
        # The weights are the average's, untouched by the forward.
        np.testing.assert_array_equal(average.params["dense"]["kernel"],
                                      kernel64.astype(np.float32))
    # A bfloat16 forward (config.compute_dtype) leaves the statistics float32.
    low = moving_average.batchnorm_forward(average, model, jnp.asarray(x), jnp.bfloat16,
                                           jax.random.key(9), apply_model=apply_model)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(low.batch_stats))


@pytest.mark.parametrize("overrides, words", [
    ({"moving_average": True, "swad": True}, ["config.moving_average=True", "config.swad=True"]),
    ({"moving_average_batchnorm_forward": True}, ["without config.moving_average=True"]),
    ({"moving_average": True, "moving_average_batchnorm_forward": True},
     ["config.freeze_batchnorm=True", "--config.freeze_batchnorm=False"]),
    ({"moving_average_start": 0}, ["config.moving_average_start=0"]),
])
def test_settings_a_moving_average_cannot_honour_are_named(overrides, words):
    problems = "\n".join(config_problems(digits_config(**overrides)))
    assert all(w in problems for w in words), problems


START = 2  # the weights after steps 0 .. t are averaged (update 1 = step 0 is S - 1)


@pytest.fixture(scope="module")
def averaged_run(tmp_path_factory):
    """A RotatedDigits run of 5 steps with its moving average from update 2, and the
    parameters after each of its steps."""
    monkeypatch = pytest.MonkeyPatch()
    trajectory = []
    record_params(monkeypatch, trajectory)
    workdir = tmp_path_factory.mktemp("averaged")
    try:
        records = train.train_and_evaluate(
            digits_config(moving_average=True, moving_average_start=START), str(workdir))
    finally:
        monkeypatch.undo()
    return workdir, records, trajectory


@pytest.mark.slow
def test_a_run_predicts_with_its_average(averaged_run):
    workdir, records, trajectory = averaged_run
    assert [r["step"] for r in records] == [0, 2, 4] and len(trajectory) == 5
    # The average after step t: the float64 mean of the weights after steps S - 2 .. t
    # (at step 0, update 1 < S: the weights themselves), in every kept checkpoint.
    kept = saved_steps(str(workdir))
    assert 4 in kept
    for t in kept:
        _, variables, record = loading.load_run(str(workdir), t)
        first = START - 2 if t + 1 >= START else t
        want = jax.tree.map(lambda *p: np.mean(np.stack(p).astype(np.float64), 0),
                            *trajectory[first:t + 1])
        for got, w in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(want)):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
        assert record["moving_average"] == {"start": START, "count": max(t + 2 - START, 0),
                                            "first_step": first, "last_step": t}
    assert records[0]["moving_average"] == {"start": START, "count": 0, "first_step": 0,
                                            "last_step": 0}
    # Each kept checkpoint's record is its average's evaluation; the trained weights
    # (restore_variables(moving_average=False)) are the last step's.
    assert_the_evaluation_reproduces_the_record(workdir, "latest")
    assert_the_evaluation_reproduces_the_record(workdir, "best")
    trained = restore_variables(str(workdir), 4, moving_average=False)
    for got, w in zip(jax.tree.leaves(trained["params"]), jax.tree.leaves(trajectory[4])):
        np.testing.assert_array_equal(got, w)
    best = loading.load_run(str(workdir), "moving_average")
    assert best[2]["step"] == loading.load_run(str(workdir), "best")[2]["step"]


def test_which_moving_average_is_refused_for_a_run_without_one(tmp_path):
    rundir.write_json(str(tmp_path / "config.json"), digits_config().to_dict())
    rundir.write_json(str(tmp_path / "run_info.json"), {})
    (tmp_path / "results.jsonl").write_text("")
    with pytest.raises(ValueError, match="kept no moving average"):
        loading.load_run(str(tmp_path), "moving_average")


class _Stopped(Exception):
    pass


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_average(
    averaged_run, tmp_path, monkeypatch
):
    """Stopped right after its checkpoint of step 2 is saved (as a kill would), the
    relaunched run ends with the uninterrupted run's records and averages, bit for bit."""
    whole, _, _ = averaged_run
    config = digits_config(moving_average=True, moving_average_start=START)
    save = train.Checkpoints.save

    def save_then_stop(self, t, *args, **kwargs):
        save(self, t, *args, **kwargs)
        if t == 2:
            raise _Stopped

    monkeypatch.setattr(train.Checkpoints, "save", save_then_stop)
    with pytest.raises(_Stopped):
        train.train_one_run(config, str(tmp_path))
    monkeypatch.setattr(train.Checkpoints, "save", save)
    train.train_one_run(config, str(tmp_path))

    def kept(workdir):
        return [{k: v for k, v in r.items() if k not in ("args",)}
                | {"args": {**r["args"], "output_dir": None}}
                for r in rundir.read_records(str(workdir))]

    assert kept(tmp_path) == kept(whole)
    for averaged in (True, False):
        got = restore_variables(str(tmp_path), 4, moving_average=averaged)
        want = restore_variables(str(whole), 4, moving_average=averaged)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_each_run_of_a_pack_keeps_its_own_average(tmp_path, monkeypatch):
    """Two runs (seeds 0 and 1) packed with vmapped lanes: each run's checkpointed
    average is the float64 mean of its own lane's weights after steps S - 2 .. 4."""
    trajectory = []
    step = packed.VmapLanes.step

    def recording(self, batches, active):
        step(self, batches, active)
        trajectory.append(jax.device_get(self.states.params))

    monkeypatch.setattr(packed.VmapLanes, "step", recording)
    configs = [digits_config(moving_average=True, moving_average_start=START, seed=s)
               for s in (0, 1)]
    dirs = [str(tmp_path / f"run{r}") for r in range(2)]
    packed.train_pack(configs, dirs, lanes="vmap")
    assert len(trajectory) == 5
    averages = []
    for r, workdir in enumerate(dirs):
        _, variables, record = loading.load_run(workdir, 4)
        want = jax.tree.map(lambda *p, r=r: np.mean(np.stack(p).astype(np.float64), 0)[r],
                            *trajectory[START - 2:])
        for got, w in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(want)):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
        assert record["moving_average"]["count"] == 4 + 2 - START
        averages.append(jax.tree.leaves(variables["params"])[0])
    assert not np.allclose(averages[0], averages[1])


@pytest.mark.slow
def test_erm_plus_plus_forward_in_a_run_with_trainable_batchnorm(tmp_path, monkeypatch):
    """A (reduced: one block of 8 channels per stage) ResNet-18 run with trainable
    BatchNorm, before its average starts (update 2 <
    S = 10: the average is a copy of the weights), with ERM++'s forward: the average's
    first BatchNorm mean after step 1 is ``0.9 m + 0.1 batch``, ``m`` the trained
    network's, ``batch`` the mean of the first convolution's output on step 1's batch,
    computed here in float64 (the digits need no augmentation)."""
    from sagm_jax import data as data_lib
    from sagm_jax.models import resnet

    monkeypatch.setitem(resnet.ARCHITECTURES, "resnet18", ("basic", (1, 1, 1, 1)))
    monkeypatch.setattr(resnet, "STAGE_WIDTHS", (8, 8, 8, 8))
    config = digits_config(
        arch="resnet18", pretrained_weights="none", freeze_batchnorm=False, algorithm="erm",
        steps=2, eval_every=1, moving_average=True, moving_average_start=10,
        moving_average_batchnorm_forward=True,
    )
    train.train_and_evaluate(config, str(tmp_path))
    average = restore_variables(str(tmp_path), 1)
    trained = restore_variables(str(tmp_path), 1, moving_average=False)
    for got, want in zip(jax.tree.leaves(average["params"]), jax.tree.leaves(trained["params"]),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    kernel = np.asarray(trained["params"]["conv1"]["kernel"], np.float64)
    batch = next(data_lib.from_config(config).train_iterator(
        range(1, 6), seed=0, batch_per_env=8, start_step=1))
    out = jax.lax.conv_general_dilated(
        np.asarray(batch["image"], np.float64), kernel, (2, 2), ((3, 3), (3, 3)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=jax.lax.Precision.HIGHEST,
    )
    want = (0.9 * np.asarray(trained["batch_stats"]["bn1"]["mean"], np.float64)
            + 0.1 * np.asarray(out).mean(axis=(0, 1, 2)))
    got = np.asarray(average["batch_stats"]["bn1"]["mean"])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    assert not np.allclose(got, trained["batch_stats"]["bn1"]["mean"])


def test_a_run_written_before_the_moving_average_existed_is_the_same_run(tmp_path):
    """A config.json without the moving average's keys ran without one: relaunched with
    their defaults it is the same run; with config.moving_average=True it is another."""
    config = digits_config().to_dict()
    written = {k: v for k, v in config.items() if not k.startswith("moving_average")}
    rundir.write_json(str(tmp_path / rundir.CONFIG), written)
    assert rundir.config_differences(str(tmp_path), config) == []
    assert rundir.config_differences(str(tmp_path), {**config, "moving_average": True}) == [
        "moving_average"]
