"""Checkpoints: one orbax manager per run, keeping the latest and the best evaluation.

``workdir/checkpoints/<step>/`` holds the train state after update ``step``, named by
the step of the record written for it (``Selected step 300`` is ``checkpoints/300``).
Each save carries the record's training-domain validation accuracy
(``sagm_jax.selection.validation_accuracy``) as its metric, and the manager's
preservation policy keeps two checkpoints at most:

* the latest one (resume);
* the best one by training-domain validation, the earliest on a tie, which is the step
  ``sagm_jax.selection.training_domain_validation`` selects from the records.

Every process of a multi-host run saves at every evaluation and the policy decides,
from metrics that are global reductions and so identical on every host, what is kept:
no process can enter a save that another skips (orbax's saves end in a barrier).
"""

from __future__ import annotations

import math
import os

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from sagm_jax import rundir

DIRECTORY = rundir.CHECKPOINTS


def _rank(metrics: dict):
    """Higher validation first; on a tie the earlier step ranks higher."""
    return (metrics["validation"], -metrics["step"])


def _manager(workdir: str, saving: bool = True) -> ocp.CheckpointManager:
    directory = os.path.abspath(os.path.join(workdir, DIRECTORY))
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
    options = ocp.CheckpointManagerOptions(preservation_policy=policy)
    return ocp.CheckpointManager(directory, options=options)


class Checkpoints:
    """Saving and restoring one run's train state (a no-op when ``enabled`` is False)."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.manager = _manager(workdir) if enabled else None

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
        self.manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics)

    def latest_step(self) -> int | None:
        return None if self.manager is None else self.manager.latest_step()

    def wait(self) -> None:
        """Waits for a pending asynchronous save."""
        if self.manager is not None:
            self.manager.wait_until_finished()


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
