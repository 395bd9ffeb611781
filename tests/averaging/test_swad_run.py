"""SWAD in a run (sagm_jax.averaging.swad, sagm_jax.averaging.swad_averages): the averaged model is the mean of
the per-step weights over the valley's segments, the valley's end stops the run, and
load_run gives the SWAD model; tests/training/test_train.py kills and resumes a SWAD run."""

import jax
import numpy as np
import pytest
from run_fixtures import digits_config, record_params

from sagm_jax.averaging import swad as swad_run
from sagm_jax.averaging import valley as swad
from sagm_jax.training import loading, rundir, train

SWAD = dict(swad=True, swad_eval_every=2, swad_n_converge=2, swad_n_tolerance=3)


def _valley_losses(records, train_envs):
    return [np.mean([r[f"env{e}_out_loss"] for e in train_envs]) for r in records]


@pytest.mark.slow
def test_the_swad_model_is_the_mean_of_the_steps_over_the_valleys_segments(tmp_path, monkeypatch):
    trajectory = []
    record_params(monkeypatch, trajectory)
    config = digits_config(
        steps=13, swad_tolerance_ratio=100.0, num_devices=0, **SWAD
    )
    records = train.train_and_evaluate(config, str(tmp_path))
    steps = [r["step"] for r in records]
    assert steps == [0, 2, 4, 6, 8, 10, 12] and len(trajectory) == 13
    segments, dead_at = swad.select_segments(
        _valley_losses(records, range(1, 6)), n_converge=2, n_tolerance=3,
        tolerance_ratio=100.0,
    )
    assert dead_at is None and segments
    # Segment k: the steps after evaluation k-1 up to evaluation k (segment 0: step 0).
    bounds = [(0, 0)] + [(steps[k - 1] + 1, steps[k]) for k in range(1, len(steps))]
    segment_means = [
        jax.tree.map(lambda *p: np.mean(np.stack(p).astype(np.float64), 0),
                     *trajectory[a : b + 1])
        for a, b in bounds
    ]
    expected = jax.tree.map(
        lambda *p: np.mean(np.stack(p), 0), *[segment_means[k] for k in segments]
    )
    model, variables, record = loading.load_run(str(tmp_path), which="swad")
    for got, want in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert record["swad"]["segments"] == len(segments)
    assert record["swad"]["first_step"] == min(bounds[k][0] for k in segments)
    assert record["swad"]["last_step"] == max(bounds[k][1] for k in segments)
    # The SWAD model's record holds its own evaluation, DomainBed's keys included.
    logits = model.apply(variables, np.zeros((2, 28, 28, 1), np.float32), train=False)
    assert logits.shape == (2, 10)
    assert set(k for k in records[-1] if k.startswith("env")) <= set(record)
    assert rundir.read_swad_record(str(tmp_path)) == record


@pytest.mark.slow
def test_the_valleys_end_stops_the_run_and_says_so(tmp_path, monkeypatch, capsys):
    # The valley reads a designed loss per evaluation (step t -> LOSSES[t // 2]): it falls,
    # converges at evaluation 2 (tolerance (3 + 3.5) / 2 = 3.25), then stays above the
    # tolerance, so it dies once the 3-evaluation window is all above it.
    losses = [5.0, 4.0, 3.0, 3.5, 3.6, 3.7, 3.8, 3.9, 4.0, 4.1, 4.2, 4.3, 4.4]
    monkeypatch.setattr(
        swad_run, "validation_loss", lambda record, envs: losses[record.get("step", 0) // 2]
    )
    valley = swad.select_segments(losses, n_converge=2, n_tolerance=3, tolerance_ratio=0.0)
    expected_dead_step = 2 * valley[1]
    # On digits_config's one device: the valley and the stop are decided on the host (the
    # averages on eight devices: the test above).
    config = digits_config(steps=25, swad_tolerance_ratio=0.0, **SWAD)
    records = train.train_and_evaluate(config, str(tmp_path / "stopped"))
    record = rundir.read_swad_record(str(tmp_path / "stopped"))
    assert records[-1]["step"] == record["swad"]["dead_at_step"] == expected_dead_step < 24
    assert "the loss valley ended at step" in capsys.readouterr().out
    # The finished run reads back (its records are a prefix of the schedule's).
    assert [r["step"] for r in rundir.read_records(str(tmp_path / "stopped"))] == [
        r["step"] for r in records
    ]
    # swad_stop_at_valley_end=False trains the whole schedule; the same valley decides.
    config.swad_stop_at_valley_end = False
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    assert full[-1]["step"] == 24
    assert rundir.read_swad_record(str(tmp_path / "full"))["swad"]["dead_at_step"] == (
        expected_dead_step
    )


@pytest.mark.slow
def test_trainable_batchnorm_statistics_are_recomputed_for_the_averaged_weights(tmp_path):
    """update_bn: the SWAD model's first BatchNorm holds the mean, over the next
    swad_batchnorm_batches training minibatches, of its input's batch mean, computed here
    from the first convolution (the digits need no augmentation)."""
    from sagm_jax import data as data_lib

    # On digits_config's one device: the statistics are those of the global batch on any
    # number (the sharded ResNet only compiles slower on fake devices).
    config = digits_config(
        arch="resnet18", pretrained_weights="none", freeze_batchnorm=False, algorithm="erm",
        steps=2, swad_batchnorm_batches=2, **dict(SWAD, swad_eval_every=1),
    )
    train.train_and_evaluate(config, str(tmp_path))
    _, variables, _ = loading.load_run(str(tmp_path), which="swad")
    kernel = np.asarray(variables["params"]["conv1"]["kernel"], np.float64)
    dataset = data_lib.from_config(config)
    batches = dataset.train_iterator(range(1, 6), seed=0, batch_per_env=8, start_step=2)
    means = []
    for _ in range(2):
        x = np.asarray(next(batches)["image"], np.float64)
        out = jax.lax.conv_general_dilated(
            x, kernel, (2, 2), ((3, 3), (3, 3)), dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=jax.lax.Precision.HIGHEST,
        )
        means.append(np.asarray(out).mean(axis=(0, 1, 2)))
    recomputed = np.asarray(variables["batch_stats"]["bn1"]["mean"])
    np.testing.assert_allclose(recomputed, np.mean(means, 0), rtol=1e-3, atol=1e-5)
