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

Pruning is atomic as a reader sees it: orbax renames a step it drops to
``checkpoints/pruned/<step>`` (its ``todelete_subdir``; one ``rename``, and a name that
is no step), and that folder is removed after each save. A kill in the middle leaves a
partial ``pruned/<step>`` that no reader lists; the next start removes it, and with it
any step folder without orbax's ``_CHECKPOINT_METADATA`` (half-deleted in place by a
version that deleted steps where they were).

A checkpoint that does not read (a truncated or lost file) is kept aside as
``checkpoints/<step>.damaged`` (no step name either) when the run resumes, with one
warning line, and the run resumes from the newest one that reads: the records after it
are dropped and trained again, so it ends as the uninterrupted run does. Where none
reads, :class:`DamagedCheckpointError` says so, naming the folder and what to do.

Each checkpoint's metrics also hold its record's training metrics (the mean ``loss``
and the method's means since the previous record), which only training can produce: a
record lost from ``results.jsonl`` is rebuilt from its checkpoint and them
(``train.rebuild_record``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from sagm_jax.training import rundir

DIRECTORY = rundir.CHECKPOINTS
SWAD_DIRECTORY = rundir.SWAD_MODEL
PRUNED = "pruned"  # orbax's todelete_subdir: where a dropped step is renamed, then removed
DAMAGED = ".damaged"  # suffix of a step folder that does not read, kept aside
COMMITTED = "_CHECKPOINT_METADATA"  # orbax writes it in every step folder it commits


class DamagedCheckpointError(OSError):
    """A checkpoint (or every checkpoint) of a run cannot be read."""


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
        todelete_subdir=PRUNED,  # a rename: atomic as a reader sees it (module docstring)
    )
    return ocp.CheckpointManager(directory, options=options)


class Checkpoints:
    """Saving and restoring one run's train state (a no-op when ``enabled`` is False)."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.directory = _directory(workdir)
        if enabled:
            _sweep(self.directory)  # before the manager lists the steps
        self.manager = _manager(workdir) if enabled else None

    def restore_latest(self, state):
        """The newest checkpoint that reads, restored into ``state``'s shapes and
        shardings, or ``None`` when there is none. Newer ones that do not read are kept
        aside (:func:`_set_aside`) with one warning line; where none reads, a
        :class:`DamagedCheckpointError`."""
        if self.manager is None or self.manager.latest_step() is None:
            return None
        damaged = []  # (step, reason), newest first
        for step in sorted(self.manager.all_steps(), reverse=True):
            restored, reason = _attempt(lambda s=step: self.restore(s, state))
            if _everywhere(reason is None):
                break
            damaged.append((step, reason or "unreadable on another process"))
        else:
            raise DamagedCheckpointError(_none_reads(self.directory, damaged))
        if damaged:
            self._set_aside(damaged, step)
        return restored

    def restore(self, step: int, state):
        """Checkpoint ``step`` restored into ``state``'s shapes and shardings."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def _set_aside(self, damaged: list, resumed: int) -> None:
        """Renames each damaged step folder to ``<step>.damaged`` (process 0, then every
        process waits for it) and says so in one line on stderr."""
        moved = []
        for step, reason in damaged:
            target = _damaged_path(self.directory, step)
            if jax.process_index() == 0:
                os.rename(os.path.join(self.directory, str(step)), target)
            moved.append(f"step {step} ({reason}) kept aside as {os.path.basename(target)}")
        _sync("sagm_jax: damaged checkpoints set aside")
        self.manager.reload()
        if jax.process_index() == 0:
            print(
                f"Warning: {self.directory}: {'; '.join(moved)}: it does not read. Resuming "
                f"from step {resumed}; the records after it are trained again.",
                file=sys.stderr, flush=True,
            )

    def training_metrics(self, step: int) -> dict | None:
        """The training metrics saved with checkpoint ``step`` (:meth:`save`), or None."""
        return stored_training_metrics(os.path.dirname(self.directory), step)

    def save(self, step: int, state, validation: float, training: dict | None = None) -> None:
        """Saves ``state`` as the checkpoint of record ``step``, ranked by ``validation``;
        ``training``, the record's training means (``loss`` and the method's metrics, as
        ``train.evaluate_and_record`` takes them), is kept with it, so that a lost record
        can be made again."""
        if self.manager is None:
            return
        if not math.isfinite(validation):
            raise FloatingPointError(
                f"training-domain validation accuracy at step {step} is {validation}; "
                "no checkpoint can be ranked by it."
            )
        metrics = {"validation": float(validation), "step": int(step)}
        if training is not None:
            metrics["training"] = dict(training)
        failure = None
        with _stops_held(), _save_errors_held() as held:
            try:
                self.manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics)
            except Exception as error:
                held.clear()  # the message below says it; ``from`` keeps the traceback
                failure = error
            else:
                if jax.process_index() == 0:  # orbax prunes on the primary host
                    shutil.rmtree(os.path.join(self.directory, PRUNED), ignore_errors=True)
        if failure is not None:
            _drop_closed_loop_callbacks()
            raise OSError(self._failure(step, failure)) from failure

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


def _drop_closed_loop_callbacks() -> None:
    """After a failed save the run ends with its one-line message, but the failed save's
    tensorstore writes may still call back into orbax's closed event loop from their
    threads after :func:`_save_errors_held` has ended (a race), which Python reports as
    an unraisable ``RuntimeError('Event loop is closed')`` with its traceback; and when
    the failed writes' asyncio tasks are collected (after the save, whenever the garbage
    collector runs), asyncio logs each one's error ("Task exception was never
    retrieved"), the same failed write the message names. From then on those reports are
    dropped; any other unraisable exception or asyncio error is still printed."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == CLOSED_LOOP:
            return
        previous(unraisable)

    def failed_write(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            "exception was never retrieved" in record.getMessage()
            and error is not None
            and any(text in str(error) for text in FAILED_WRITE)
        )

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(failed_write)


CLOSED_LOOP = "Event loop is closed"  # asyncio's message for a call into a closed loop
FAILED_WRITE = ("RESOURCE_EXHAUSTED", "Error writing")  # tensorstore's failed-write errors
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


def _sweep(directory: str) -> None:
    """Removes what a kill during pruning left (process 0; the others wait): the
    ``pruned`` folder, and step folders without ``_CHECKPOINT_METADATA``."""
    if jax.process_index() == 0 and os.path.isdir(directory):
        shutil.rmtree(os.path.join(directory, PRUNED), ignore_errors=True)
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if name.isdigit() and os.path.isdir(path) and not _committed(path):
                shutil.rmtree(path)
    _sync("sagm_jax: checkpoints swept")


def _committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMITTED))


def _sync(name: str) -> None:
    """A barrier of every process of a multi-host run (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process: they all resume from the same step."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _attempt(read):
    """``(read(), None)``, or ``(None, reason)`` where it raises: orbax's and
    TensorStore's reports of a damaged file held back, the reason in one line."""
    with _save_errors_held() as held:
        try:
            return read(), None
        except Exception as error:  # noqa: BLE001  any failure to read is "damaged"
            held.clear()
            return None, _root_reason(error)


def _root_reason(error: BaseException) -> str:
    """The first line of the error at the root of ``error``'s chain (TensorStore's
    "OUT_OF_RANGE: ... not valid for value of size 10" under orbax's wrappers)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    first = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:240]}{'...' if len(first) > 240 else ''}"


def _damaged_path(directory: str, step: int) -> str:
    """``<step>.damaged``, or ``<step>.damaged-2``, ... where that is taken."""
    path, n = os.path.join(directory, f"{step}{DAMAGED}"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(directory, f"{step}{DAMAGED}-{n}")
    return path


def _none_reads(directory: str, damaged: list) -> str:
    failures = "; ".join(f"step {step}: {reason}" for step, reason in damaged)
    return (
        f"no checkpoint in {directory} can be read ({failures}), so the run cannot "
        "resume; the checkpoints and the records are left as they are. To train it "
        f"again from step 0 in this directory, move that folder aside (mv {directory} "
        f"{directory}{DAMAGED}) and run the same command; or restore the folder from a copy "
        "and run the same command to resume."
    )


def saved_steps(workdir: str) -> list[int]:
    """The steps of the checkpoints kept in ``workdir``: its step folders that orbax
    committed (a folder half-deleted by a kill, or set aside, is none)."""
    directory = _directory(workdir)
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(name) for name in os.listdir(directory)
        if name.isdigit() and _committed(os.path.join(directory, name))
    )


def stored_training_metrics(workdir: str, step: int) -> dict | None:
    """The record's training metrics saved with checkpoint ``step`` (``loss`` and the
    method's means), or None (no such checkpoint, or one saved before they were)."""
    path = os.path.join(_directory(workdir), str(step), "metrics", "metrics")
    try:
        with open(path) as f:
            training = json.load(f).get("training")
    except (OSError, ValueError, AttributeError):
        return None
    return training if isinstance(training, dict) and "loss" in training else None


def restore_variables(workdir: str, step: int, moving_average: bool = True) -> dict:
    """``{'params': ..., 'batch_stats': ...}`` of checkpoint ``step`` as host arrays,
    without rebuilding the optimizer (whatever its mode or axis names were): the
    variables the run predicts with, its moving average's where it keeps one
    (``config.moving_average``; ``moving_average=False``: the trained weights). A step
    that is not kept is a ``FileNotFoundError`` listing the steps that are; one that
    does not read, a :class:`DamagedCheckpointError` naming it and the steps that read."""
    directory, steps = _directory(workdir), saved_steps(workdir)
    _check_layout(directory)
    if step not in steps:
        raise FileNotFoundError(
            f"{directory} holds no checkpoint of step {step} (it holds the steps {steps})."
        )
    restored, reason = _attempt(lambda: _read_step(directory, step))
    if reason is not None:
        others = [s for s in steps if s != step]
        readable = [s for s in others if _attempt(lambda s=s: _read_step(directory, s))[1] is None]
        raise DamagedCheckpointError(
            f"{os.path.join(directory, str(step))}: the checkpoint of step {step} is damaged "
            f"and cannot be read ({reason}). The steps that read: {readable}."
        )
    if moving_average and restored.get("moving_average"):  # sagm_jax.averaging.moving_average
        restored = restored["moving_average"]
    return {"params": restored["params"], "batch_stats": restored.get("batch_stats") or {}}


def _read_step(directory: str, step: int) -> dict:
    """Everything saved in checkpoint ``step``, as host arrays, read without a manager
    (which would list every step folder, and warn about any that is not whole)."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(os.path.join(directory, str(step), "default"))


def _check_layout(directory: str) -> None:
    if os.path.isdir(os.path.join(directory, "latest")):
        _manager(os.path.dirname(directory), saving=False)  # raises, naming the layout


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


def weights_sha256(variables: dict) -> str:
    """The SHA-256 of the variables' bytes, leaf by leaf in tree order (the params, then
    the batch statistics, each in sorted key order), with each leaf's dtype and shape: a
    run's weights as soups fingerprint their members and a shared start its parent."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves({"params": variables["params"],
                                 "batch_stats": variables.get("batch_stats") or {}}):
        leaf = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{leaf.dtype.str}{leaf.shape}".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()
