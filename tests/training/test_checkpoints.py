"""sagm_jax.training.checkpoints: what is kept (the latest and the best, earliest on a tie, also
across relaunches), that what is restored is bit for bit what was saved, with or without
an optimizer, and that a full disk is one message at the save that failed."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sagm_jax.results import selection
from sagm_jax.training.checkpoints import (
    Checkpoints,
    DamagedCheckpointError,
    restore_variables,
    saved_steps,
    stored_training_metrics,
)
from sagm_jax.training.train_step import TrainState, create_train_state


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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_a_save_waits_for_the_save_then_stops(tmp_path, monkeypatch, signum):
    """Ctrl-C (or SIGTERM, which the run maps to it) in the middle of a save: the save
    completes and restores, then the run stops with KeyboardInterrupt. Both signals get
    Python's KeyboardInterrupt handler here, whatever pytest inherited (a background or
    ``nohup`` launch ignores SIGINT)."""
    previous = {
        sig: signal.signal(sig, signal.default_int_handler)
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    checkpoints = Checkpoints(str(tmp_path))
    save = checkpoints.manager.save

    def save_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)  # delivered now, in the middle of the save
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoints.manager, "save", save_interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoints.save(4, state_at(4), 0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert saved_steps(str(tmp_path)) == [4]
    assert_same_values(Checkpoints(str(tmp_path)).restore_latest(state_at(0)), state_at(4))


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


def best_and_latest(validations: dict) -> list[int]:
    """The two steps the README promises, from the validations alone: the newest step,
    and the highest validation (the earliest step among equals)."""
    highest = max(validations.values())
    best = min(step for step, v in validations.items() if v == highest)
    return sorted({best, max(validations)})


@pytest.mark.parametrize(
    "segments",
    [
        # killed after 10, 20, 30 (the run) and resumed to 39
        [{0: 0.25, 10: 0.75, 20: 0.5, 30: 0.625}, {39: 0.5}],
        # the best comes after the restart; then a tie with an earlier step
        [{0: 0.25, 10: 0.5}, {20: 0.75, 30: 0.25}, {40: 0.75, 49: 0.5}],
        # a restart after every checkpoint
        [{0: 0.5}, {10: 0.25}, {20: 0.5}, {30: 0.625}, {39: 0.125}],
    ],
)
def test_a_relaunched_run_still_keeps_exactly_the_latest_and_the_best(tmp_path, segments):
    """Each segment is one launch: a new ``Checkpoints`` (as a relaunch makes), the
    restore, then its saves; the folder holds the two promised steps after every save."""
    fed = {}
    for segment in segments:
        checkpoints = Checkpoints(str(tmp_path))
        restored = checkpoints.restore_latest(state_at(99))
        if fed:
            assert_same_values(restored, state_at(max(fed)))
        for step, validation in segment.items():
            checkpoints.save(step, state_at(step), validation)
            checkpoints.wait()
            fed[step] = validation
            assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints")) == (
                best_and_latest(fed)
            ), f"after saving step {step} of {fed}"
    assert sorted(saved_steps(str(tmp_path))) == best_and_latest(fed)
    for step in best_and_latest(fed):  # what the next relaunch will rank them by
        with open(tmp_path / "checkpoints" / str(step) / "metrics" / "metrics") as f:
            assert json.load(f) == {"validation": fed[step], "step": step}


@pytest.fixture
def small_disk(tmp_path):
    """A fresh 1 MiB file system (tmpfs) at ``tmp_path/disk``; skipped where this process
    may not mount one (not root, or no mount namespace rights)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def large_state(step: int) -> TrainState:
    """400 KiB of parameters (plain SGD: no optimizer state), so that two checkpoints fit
    on ``small_disk`` and a third one, written before the older one is pruned, does not."""
    rng = np.random.default_rng(step)
    params = {"w": jnp.asarray(rng.normal(size=(100, 1024)), jnp.float32)}
    return create_train_state({"params": params, "batch_stats": {}}, optax.sgd(0.1))


def test_a_full_disk_is_one_message_at_the_save_that_failed(small_disk, caplog,
                                                             monkeypatch):
    """Raised by the save that failed, one line naming the folder and its free space,
    with none of orbax's logged ERRORs before it; what was kept stays."""
    checkpoints = Checkpoints(str(small_disk))
    checkpoints.save(0, large_state(0), 0.5)  # the best
    checkpoints.save(10, large_state(10), 0.25)  # the latest
    seen = []  # what reaches the process's unraisable hook from here on
    monkeypatch.setattr(sys, "unraisablehook", lambda report: seen.append(str(report.exc_value)))
    with caplog.at_level(logging.INFO), pytest.raises(OSError) as raised:
        checkpoints.save(20, large_state(20), 0.125)
    message = str(raised.value)
    free = shutil.disk_usage(small_disk).free
    assert "\n" not in message
    assert f"step 20 in {small_disk / 'checkpoints'}:" in message
    assert f"{free:,} bytes free" in message
    assert "no space left on device" in message.lower()
    assert raised.value.__cause__ is not None  # the original, for --traceback
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], "orbax's own tracebacks precede the message"
    _late_callbacks_are_dropped(seen)
    checkpoints.wait()  # the trainer waits in a finally: it must not raise over the message
    assert sorted(saved_steps(str(small_disk))) == [0, 10]
    restored = Checkpoints(str(small_disk)).restore_latest(large_state(99))
    assert_same_values(restored, large_state(10))
    assert sorted(os.listdir(small_disk / "checkpoints")) == ["0", "10"]  # the relaunch cleaned


def _late_callbacks_are_dropped(seen: list) -> None:
    """A write of the failed save calling into orbax's closed event loop after the save
    has returned (a race: its thread may run late) is not reported; another unraisable
    exception still is (``seen``: what reaches the hook the run had)."""
    import types

    for error in (RuntimeError("Event loop is closed"), RuntimeError("other")):
        sys.unraisablehook(types.SimpleNamespace(
            exc_type=type(error), exc_value=error, exc_traceback=None, err_msg=None,
            object=None))
    assert seen == ["other"]


FILL_THE_DISK = """
import sys
sys.path.insert(0, sys.argv[2])
from test_checkpoints import Checkpoints, large_state
checkpoints = Checkpoints(sys.argv[1])
try:
    for step, validation in [(0, 0.5), (10, 0.25), (20, 0.125)]:
        checkpoints.save(step, large_state(step), validation)
except OSError as error:
    print(error)
finally:
    checkpoints.wait()
"""


def test_a_full_disk_prints_nothing_but_the_message(small_disk):
    """In a process of its own, as a run is: the tracebacks orbax's threads print
    (tensorstore calling into a closed event loop) come before the message there."""
    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run(
        [sys.executable, "-c", FILL_THE_DISK, str(small_disk), tests],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("could not save the checkpoint of step 20 in ")
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr == "", f"{len(result.stderr.splitlines())} lines before the message"


def test_another_failed_write_names_its_error_and_the_folder(tmp_path, monkeypatch):
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(0, state_at(0), 0.5)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "checkpoints" / "2"))

    monkeypatch.setattr(checkpoints.manager, "save", refused)
    with pytest.raises(OSError, match="PermissionError: .*Permission denied") as raised:
        checkpoints.save(2, state_at(2), 0.25)
    assert f"step 2 in {tmp_path / 'checkpoints'}:" in str(raised.value)
    assert "the last good checkpoint (step 0) are kept" in str(raised.value)
    assert isinstance(raised.value.__cause__, PermissionError)


def test_what_orbax_logs_during_a_save_that_succeeds_is_still_logged(
    tmp_path, caplog, monkeypatch
):
    checkpoints = Checkpoints(str(tmp_path))
    save = checkpoints.manager.save

    def save_and_complain(*args, **kwargs):
        logging.getLogger("absl").error("a retried write")
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoints.manager, "save", save_and_complain)
    with caplog.at_level(logging.INFO):
        checkpoints.save(0, state_at(0), 0.5)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "a retried write"
    ]
    assert saved_steps(str(tmp_path)) == [0]


# --- pruning across kills, damaged checkpoints ------------------------------------------

KILLED_WHILE_PRUNING = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from test_checkpoints import Checkpoints, state_at
checkpoints = Checkpoints(sys.argv[1])
checkpoints.save(0, state_at(0), 0.5)  # the best
checkpoints.save(10, state_at(10), 0.25)  # the latest, which the next save prunes
unlink, removed = os.unlink, []

def unlink_then_die(path, *args, **kwargs):  # SIGKILL once 3 of step 10's files are gone
    unlink(path, *args, **kwargs)
    removed.append(path)
    if len(removed) == 3:
        os.kill(os.getpid(), signal.SIGKILL)

os.unlink = unlink_then_die
checkpoints.save(20, state_at(20), 0.125)
"""


def test_a_kill_while_pruning_leaves_exactly_the_latest_and_the_best(tmp_path, caplog):
    """SIGKILL in the middle of removing the pruned step 10 (a real kill, in a process of
    its own): readers see exactly 0 (the best) and 20 (the latest), a missing step is an
    error listing those, and the next start removes what the kill left."""
    tests = os.path.dirname(os.path.abspath(__file__))
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_PRUNING, str(tmp_path), tests],
        capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""}, timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    with caplog.at_level(logging.WARNING):
        assert saved_steps(str(tmp_path)) == [0, 20]
        missing = r"no checkpoint of step 10 \(it holds the steps \[0, 20\]\)"
        with pytest.raises(FileNotFoundError, match=missing):
            restore_variables(str(tmp_path), 10)
        assert_same_values(restore_variables(str(tmp_path), 20)["params"], state_at(20).params)
    assert [r.getMessage() for r in caplog.records] == []  # no "Metadata file does not exist"
    Checkpoints(str(tmp_path))  # a relaunch
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["0", "20"]


def test_a_step_half_deleted_in_place_is_no_step_and_is_swept_at_start(tmp_path, caplog):
    """What a kill during an earlier version's pruning left (``10/default/`` emptied, its
    ``_CHECKPOINT_METADATA`` gone): readers do not list it or warn about it; the next
    start removes it, and the run then keeps the latest and the best."""
    save_all(tmp_path, {0: 0.5, 10: 0.25})
    os.makedirs(tmp_path / "checkpoints" / "5" / "default")
    with caplog.at_level(logging.WARNING):
        assert saved_steps(str(tmp_path)) == [0, 10]
        with pytest.raises(FileNotFoundError, match=r"step 5 \(it holds the steps \[0, 10\]\)"):
            restore_variables(str(tmp_path), 5)
    assert [r.getMessage() for r in caplog.records] == []
    checkpoints = Checkpoints(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["0", "10"]
    checkpoints.save(20, state_at(20), 0.125)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["0", "20"]


def damage(workdir, step):
    """Truncates the data files of checkpoint ``step`` (``d/`` folders: a state this small
    is stored in the b-tree nodes themselves) to half their size, as a copy cut short or a
    failing disk would."""
    for root, _, names in os.walk(workdir / "checkpoints" / str(step) / "default"):
        if os.path.basename(root) == "d":
            for name in names:
                path = os.path.join(root, name)
                os.truncate(path, os.path.getsize(path) // 2)


def test_a_damaged_latest_is_set_aside_and_the_newest_that_reads_restored(tmp_path, capsys):
    save_all(tmp_path, {0: 0.75, 2: 0.25})
    damage(tmp_path, 2)
    checkpoints = Checkpoints(str(tmp_path))
    restored = checkpoints.restore_latest(state_at(99))
    assert_same_values(restored, state_at(0))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["0", "2.damaged"]
    assert checkpoints.latest_step() == 0 and saved_steps(str(tmp_path)) == [0]
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "step 2 (" in err and "kept aside as 2.damaged" in err and "from step 0" in err
    checkpoints.save(2, state_at(2), 0.25)  # the run trains step 2 again
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["0", "2", "2.damaged"]


def test_where_no_checkpoint_reads_one_paragraph_names_the_folder(tmp_path):
    save_all(tmp_path, {0: 0.75, 2: 0.25})
    damage(tmp_path, 0)
    damage(tmp_path, 2)
    with pytest.raises(DamagedCheckpointError) as raised:
        Checkpoints(str(tmp_path)).restore_latest(state_at(99))
    message = str(raised.value)
    assert isinstance(raised.value, OSError)  # the command line prints it alone
    assert "\n" not in message and len(message) < 1500
    directory = tmp_path / "checkpoints"
    assert message.startswith(f"no checkpoint in {directory} can be read (step 2: ")
    assert "; step 0: " in message and f"mv {directory} {directory}.damaged" in message
    assert sorted(os.listdir(directory)) == ["0", "2"]  # nothing moved


def test_restore_variables_names_a_damaged_step_and_the_steps_that_read(tmp_path):
    save_all(tmp_path, {0: 0.75, 2: 0.25, 4: 0.5})  # keeps 0 and 4
    damage(tmp_path, 4)
    with pytest.raises(DamagedCheckpointError) as raised:
        restore_variables(str(tmp_path), 4)
    message = str(raised.value)
    assert message.startswith(
        f"{tmp_path / 'checkpoints' / '4'}: the checkpoint of step 4 is damaged and cannot "
        "be read (ValueError: "
    ), message
    assert message.endswith("The steps that read: [0].") and "\n" not in message


def test_the_training_metrics_are_kept_with_the_checkpoint(tmp_path):
    checkpoints = Checkpoints(str(tmp_path))
    checkpoints.save(0, state_at(0), 0.5, {"loss": 2.25, "penalty": 0.125})
    checkpoints.save(2, state_at(2), 0.25)  # saved without them (an earlier version)
    assert checkpoints.training_metrics(0) == {"loss": 2.25, "penalty": 0.125}
    assert stored_training_metrics(str(tmp_path), 0) == {"loss": 2.25, "penalty": 0.125}
    assert checkpoints.training_metrics(2) is None
    assert stored_training_metrics(str(tmp_path), 4) is None
