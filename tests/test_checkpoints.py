"""sagm_jax.checkpoints: what is kept (the latest and the best, earliest on a tie), and
that what is restored is bit for bit what was saved, with or without an optimizer."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sagm_jax import selection
from sagm_jax.checkpoints import Checkpoints, restore_variables, saved_steps
from sagm_jax.train_step import TrainState, create_train_state


def state_at(step: int) -> TrainState:
    """A train state with Adam's state, its values drawn from ``step``."""
    rng = np.random.default_rng(step)
    params = {
        "dense": {
            "kernel": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        }
    }
    batch_stats = {"norm": {"mean": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}}
    state = create_train_state({"params": params, "batch_stats": batch_stats}, optax.adam(1e-3))
    return state.replace(step=jnp.asarray(step + 1, jnp.int32))


def save_all(workdir, validations: dict) -> Checkpoints:
    """Saves ``state_at(step)`` ranked by ``validations[step]``, in step order."""
    checkpoints = Checkpoints(str(workdir))
    for step, validation in validations.items():
        checkpoints.save(step, state_at(step), validation)
    checkpoints.wait()
    return checkpoints


def assert_same_values(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize(
    "validations,kept",
    [
        ({0: 0.25, 2: 0.75, 4: 0.5, 6: 0.625}, [2, 6]),
        ({0: 0.25, 2: 0.75, 4: 0.75, 6: 0.5}, [2, 6]),  # a tie: the earlier step is best
        ({0: 0.25, 2: 0.5, 4: 0.75}, [4]),  # the latest is the best
        ({0: 0.5, 2: 0.5, 4: 0.5}, [0, 4]),
    ],
)
def test_keeps_exactly_the_latest_and_the_best(tmp_path, validations, kept):
    checkpoints = save_all(tmp_path, validations)
    assert sorted(saved_steps(str(tmp_path))) == kept
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints")) == kept
    assert checkpoints.latest_step() == max(validations)


def test_restore_latest_gives_back_the_saved_state_bit_for_bit(tmp_path):
    save_all(tmp_path, {0: 0.5, 2: 0.25})
    template = state_at(99)  # shapes and dtypes only
    restored = Checkpoints(str(tmp_path)).restore_latest(template)
    assert_same_values(restored, state_at(2))
    assert int(restored.step) == 3


def test_restore_latest_of_a_new_run_is_none(tmp_path):
    assert Checkpoints(str(tmp_path)).restore_latest(state_at(0)) is None


def test_restore_variables_needs_no_optimizer(tmp_path):
    save_all(tmp_path, {0: 0.75, 2: 0.25})
    expected = state_at(0)
    variables = restore_variables(str(tmp_path), 0)
    assert set(variables) == {"params", "batch_stats"}
    assert_same_values(variables["params"], expected.params)
    assert_same_values(variables["batch_stats"], expected.batch_stats)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 1 .*\[0, 2\]"):
        restore_variables(str(tmp_path), 1)


def test_a_state_without_batch_stats_restores_empty_batch_stats(tmp_path):
    state = state_at(0).replace(batch_stats={})
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(0, state, 0.5)
    checkpoints.wait()
    assert restore_variables(str(tmp_path), 0)["batch_stats"] == {}


def test_a_non_finite_validation_cannot_rank_a_checkpoint(tmp_path):
    checkpoints = Checkpoints(str(tmp_path))
    with pytest.raises(FloatingPointError, match="step 3 is nan"):
        checkpoints.save(3, state_at(3), float("nan"))
    checkpoints.wait()
    assert saved_steps(str(tmp_path)) == []


def test_disabled_checkpoints_write_nothing(tmp_path):
    checkpoints = Checkpoints(str(tmp_path), enabled=False)
    checkpoints.save(0, state_at(0), 0.5)
    checkpoints.wait()
    assert checkpoints.restore_latest(state_at(0)) is None
    assert checkpoints.latest_step() is None
    assert not os.path.exists(tmp_path / "checkpoints")


def test_the_old_latest_and_best_layout_is_refused(tmp_path):
    os.makedirs(tmp_path / "checkpoints" / "latest")
    with pytest.raises(ValueError, match="earlier sagm_jax"):
        Checkpoints(str(tmp_path))


def test_the_best_kept_is_the_step_the_selection_picks(tmp_path):
    """Ranked by ``selection.validation_accuracy`` of the run's records: the kept best is
    the step ``training_domain_validation`` picks (step 2: 0.75, tied by step 4)."""
    outs = {0: (1.0, 0.25, 0.5), 2: (0.5, 0.625, 0.875), 4: (0.0, 0.875, 0.625), 6: (1.0, 0.5, 0.5)}
    records = [
        {"step": step, **{f"env{e}_out_acc": acc for e, acc in enumerate(out)}}
        for step, out in outs.items()
    ]
    checkpoints = Checkpoints(str(tmp_path))
    for r in records:
        checkpoints.save(r["step"], state_at(r["step"]), selection.validation_accuracy(r, [1, 2]))
    checkpoints.wait()
    assert sorted(saved_steps(str(tmp_path))) == [2, 6]
    assert selection.training_domain_validation(records, [0])["step"] == 2
