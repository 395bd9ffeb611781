"""Entry point: ``python -m sagm_jax.main --config=configs/pacs.py [--workdir=DIR]``.

``--config.key=value`` overrides a config field; ``--help`` lists them all. Without
``--workdir`` the run goes to ``sagm_jax.cli.default_workdir(config)``. ``--distributed``
calls ``jax.distributed.initialize()`` first, one process per host: TPU pods and
SLURM/Open MPI clusters are detected; elsewhere pass ``--coordinator_address``,
``--num_processes`` and ``--process_id``. What the user sees around the run (help,
checks, errors, Ctrl-C) is ``sagm_jax.cli``'s.
"""

import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from sagm_jax import cli, cpu
from sagm_jax.training.rundir import RUN_LOCK

_CONFIG = config_flags.DEFINE_config_file(
    "config", lock_config=True, help_string="A configs/*.py file."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: derived from the config).")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() (one process per host)."
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show the traceback of an error.")


def claim_and_train(config, workdir: str) -> None:
    """Starts the distributed runtime (``--distributed``), claims ``workdir/run.lock``
    (process 0), runs ``train.train_and_evaluate`` and, when a start fails, removes the
    run directory it made if nothing but the lock is in it."""
    import jax

    if _DISTRIBUTED.value:
        # CPU processes (tests, CPU clusters) need a collectives backend; accelerators ignore it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
    from sagm_jax import claims
    from sagm_jax.training import train as train_lib

    had_workdir = os.path.exists(workdir)
    # One process trains a run directory at a time (the others' processes share it).
    claim = claims.try_claim(workdir, RUN_LOCK) if jax.process_index() == 0 else None
    if jax.process_index() == 0 and claim is None:  # held until this process exits
        raise cli.UsageError(
            f"--workdir={workdir}: another process is training this run (it holds "
            f"{workdir}/{RUN_LOCK}); wait for it to finish, or choose another --workdir."
        )
    try:
        train_lib.train_and_evaluate(config, workdir, launched=cli.launch_start())
    except BaseException:
        if claim is not None and not had_workdir:
            claim.release()
            _remove_if_empty(workdir)
        raise
    if _DISTRIBUTED.value:
        # Leave together: a process that exits while another still talks to the
        # coordinator (process 0) makes that one abort.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sagm_jax.main finished")
        jax.distributed.shutdown()


def _remove_if_empty(workdir: str) -> None:
    """Removes the run directory a failed start made, if nothing but its lock is in it."""
    for root, dirs, files in os.walk(workdir, topdown=False):
        if set(files) <= {RUN_LOCK} and not any(
            os.path.exists(os.path.join(root, d)) for d in dirs
        ):
            for name in files:
                os.remove(os.path.join(root, name))
            os.rmdir(root)


def _hide_accelerators_from_tensorflow() -> None:
    """TensorFlow (input only) must not take accelerator memory: hidden before any op,
    or a RuntimeError that says it is too late."""
    try:
        from sagm_jax.data import tf_input  # TensorFlow is optional
    except ImportError:
        return
    tf_input.hide_accelerators_from_tensorflow()


def _local_device_count() -> int:
    import jax

    return jax.device_count()


def main(argv):
    del argv
    cpu.configure()  # XLA reads its flags once, when JAX starts its backend
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    for line in cli.reference_defaults(_CONFIG.value, sys.argv):
        print(line, flush=True)
    workdir = _WORKDIR.value or cli.default_workdir(_CONFIG.value)

    def checked_run():
        # A multi-host job knows its devices only after jax.distributed.initialize().
        devices = None if _DISTRIBUTED.value else _local_device_count()
        cli.preflight(_CONFIG.value, workdir, sys.argv, devices)
        cli.quiet_tensorflow_import()
        _hide_accelerators_from_tensorflow()
        claim_and_train(_CONFIG.value, workdir)

    return cli.guarded(checked_run, workdir, sys.argv, _TRACEBACK.value)


if __name__ == "__main__":
    cli.check_command_line(sys.argv)
    app.run(main, flags_parser=cli.parse_flags)
