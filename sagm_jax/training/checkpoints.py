"""Checkpoints: one orbax manager per run, keeping the latest and the best evaluation.

``workdir/checkpoints/<step>/`` holds the train state after update ``step``, named by
the step of the record written for it (``Selected step 300`` is ``checkpoints/300``).
Each save carries the record's training-domain validation accuracy
(``sagm_jax.results.selection.validation_accuracy``) as its metric, and the manager's
preservation policy keeps two checkpoints at most:

* the latest one (resume);
* the best one by training-domain validation, the earliest on a tie, which is the step
  ``sagm_jax.results.selection.training_domain_validation`` selects from the records.

The metric is written with each checkpoint (``<step>/metrics``), so a relaunched run
ranks its earlier checkpoints as the first launch did and still keeps two.

Every process of a multi-host run saves at every evaluation and the policy decides,
from metrics that are global reductions and so identical on every host, what is kept:
no process can enter a save that another skips (orbax's saves end in a barrier).

Saves are synchronous: a write that fails (a full disk) is one ``OSError`` naming the
folder and its free space, raised by the ``save`` of that step, with orbax's own
tracebacks of it held back. Asynchronous saves reported it only at the next save, one
evaluation later, after pages of thread tracebacks; waiting costs the write itself,
about 0.5 s for 200 MB of train state on a local disk, once per evaluation. A failed
save leaves the records and the last good checkpoint; its partial folder is removed
when the run is relaunched.

A Ctrl-C or SIGTERM that arrives during a save is held until the save is complete and
then stops the run (``KeyboardInterrupt``): a save is never cut in half, and orbax's
commit threads never meet an interpreter that is already shutting down.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import shutil
import signal
import sys
import threading

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from sagm_jax.training import rundir

DIRECTORY = rundir.CHECKPOINTS
SWAD_DIRECTORY = rundir.SWAD_MODEL


def _rank(metrics: dict):
    """Higher validation first; on a tie the earlier step ranks higher."""
    return (metrics["validation"], -metrics["step"])


def _directory(workdir: str) -> str:
    return os.path.abspath(os.path.join(workdir, DIRECTORY))


def _manager(workdir: str, saving: bool = True) -> ocp.CheckpointManager:
    directory = _directory(workdir)
    if os.path.isdir(os.path.join(directory, "latest")):
        raise ValueError(
            f"{directory} was written by an earlier sagm_jax (latest/ and best/ "
            "sub-folders); this version cannot resume it. Use another --workdir."
        )
    if not saving:  # reading only: no policy, nothing created or deleted
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
    policy = policies.AnyPreservationPolicy(
        [policies.LatestN(n=1), policies.BestN(get_metric_fn=_rank, n=1)]
    )
    # The policy alone decides what is kept; ``best_fn`` is what makes orbax write each
    # save's metrics to disk (``<step>/metrics``). Without it a relaunched run reads its
    # earlier checkpoints back unranked, and BestN keeps every unranked one for good.
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy,
        best_fn=_rank,
        best_mode="max",
        enable_async_checkpointing=False,
        cleanup_tmp_directories=True,
    )
    return ocp.CheckpointManager(directory, options=options)


class Checkpoints:
    """Saving and restoring one run's train state (a no-op when ``enabled`` is False)."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.manager = _manager(workdir) if enabled else None
        self.directory = _directory(workdir)

    def restore_latest(self, state):
        """The newest checkpoint restored into ``state``'s shapes and shardings, or
        ``None`` when there is none."""
        if self.manager is None or self.manager.latest_step() is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        step = self.manager.latest_step()
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def save(self, step: int, state, validation: float) -> None:
        """Saves ``state`` as the checkpoint of record ``step``, ranked by ``validation``."""
        if self.manager is None:
            return
        if not math.isfinite(validation):
            raise FloatingPointError(
                f"training-domain validation accuracy at step {step} is {validation}; "
                "no checkpoint can be ranked by it."
            )
        metrics = {"validation": float(validation), "step": int(step)}
        with _stops_held(), _save_errors_held() as held:
            try:
                self.manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics)
            except Exception as error:
                held.clear()  # the message below says it; ``from`` keeps the traceback
                raise OSError(self._failure(step, error)) from error

    def _failure(self, step: int, error: Exception) -> str:
        """One line for a user: what failed, where, the free space, what is kept and
        what to do."""
        latest, reason = self.manager.latest_step(), _reason(error)
        space = f"{_free_bytes(self.directory):,} bytes free"
        if latest is None:
            kept = "The records are kept (no checkpoint was saved before)"
        else:
            size = _folder_bytes(os.path.join(self.directory, str(latest)))
            space += f"; a checkpoint takes about {size:,} bytes"
            kept = f"The records and the last good checkpoint (step {latest}) are kept"
        fix = "free space on that disk" if reason == NO_SPACE else "fix that"
        return (
            f"could not save the checkpoint of step {step} in {self.directory}: "
            f"{reason} ({space}). {kept}: {fix} (or use a --workdir elsewhere), then run "
            "the same command again to resume."
        )

    def latest_step(self) -> int | None:
        return None if self.manager is None else self.manager.latest_step()

    def wait(self) -> None:
        """Waits for any save in flight (none: saves are synchronous; kept for callers
        that end a run with it). Does not raise again for a save that failed."""
        if self.manager is not None:
            self.manager.wait_until_finished()


@contextlib.contextmanager
def _stops_held():
    """Holds SIGINT and SIGTERM until the block ends, then delivers the first one that
    came to the handler it was held from (the run's: ``KeyboardInterrupt``). Only the
    main thread can set signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received, stops = [], (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda n, _: received.append(n)) for signum in stops}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])


@contextlib.contextmanager
def _save_errors_held():
    """Holds back what orbax's threads report during a save: ERROR records on absl's
    logger and unraisable exceptions (tensorstore's writes calling back into an event
    loop already closed). Yields the list of held reports, each a call that emits it,
    and emits those left in it at the end: a failed save clears it, since its own
    message replaces them (otherwise about 200 lines for a full disk)."""
    logger, held, unraisable_hook = logging.getLogger("absl"), [], sys.unraisablehook

    def hold_record(record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        held.append(functools.partial(logger.handle, record))
        return False

    def hold_unraisable(unraisable) -> None:
        held.append(functools.partial(unraisable_hook, unraisable))

    logger.addFilter(hold_record)
    sys.unraisablehook = hold_unraisable
    try:
        yield held
    finally:
        logger.removeFilter(hold_record)
        sys.unraisablehook = unraisable_hook
        for emit in held:
            emit()


NO_SPACE = "no space left on device"


def _reason(error: BaseException) -> str:
    """``NO_SPACE`` where the error or one it came from says so (orbax wraps the
    OSError's text in a ValueError), else the error's type and first line."""
    seen = error
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left" in str(seen):
            return NO_SPACE
        seen = seen.__cause__ or seen.__context__
    first = (str(error).splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}"


def _free_bytes(path: str) -> int:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def saved_steps(workdir: str) -> list[int]:
    """The steps of the checkpoints kept in ``workdir``."""
    return list(_manager(workdir, saving=False).all_steps())


def restore_variables(workdir: str, step: int) -> dict:
    """``{'params': ..., 'batch_stats': ...}`` of checkpoint ``step`` as host arrays,
    without rebuilding the optimizer (whatever its mode or axis names were)."""
    manager = _manager(workdir, saving=False)
    if step not in manager.all_steps():
        raise FileNotFoundError(
            f"{os.path.join(workdir, DIRECTORY)} holds no checkpoint of step {step} "
            f"(it holds {list(manager.all_steps())})."
        )
    restored = manager.restore(step, args=ocp.args.StandardRestore())
    return {"params": restored["params"], "batch_stats": restored.get("batch_stats") or {}}


def save_swad_variables(workdir: str, variables: dict) -> None:
    """Writes SWAD's final model, ``{'params', 'batch_stats'}``, to ``workdir/swad_model``
    (replacing an earlier one, as a relaunch that finishes again writes it again)."""
    path = os.path.abspath(os.path.join(workdir, SWAD_DIRECTORY))
    if os.path.exists(path):
        shutil.rmtree(path)
    with _stops_held(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, variables)


def restore_swad_variables(workdir: str) -> dict:
    """SWAD's final model of a finished SWAD run (:func:`save_swad_variables`)."""
    path = os.path.abspath(os.path.join(workdir, SWAD_DIRECTORY))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path}: no SWAD model; the run in {workdir} did not train with "
            "--config.swad=True, or has not finished."
        )
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path)
    return {"params": restored["params"], "batch_stats": restored.get("batch_stats") or {}}
