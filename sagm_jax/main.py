"""Entry point: ``python -m sagm_jax.main --config=configs/pacs.py --workdir=DIR``.

``--config.key=value`` overrides a config field. ``--distributed`` calls
``jax.distributed.initialize()`` first, one process per host: TPU pods and
SLURM/Open MPI clusters are detected; elsewhere pass ``--coordinator_address``,
``--num_processes`` and ``--process_id``.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from sagm_jax.config import check_overrides

_CONFIG = config_flags.DEFINE_config_file(
    "config", lock_config=True, help_string="A configs/*.py file."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (results, checkpoints).", required=True
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() (one process per host)."
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    import jax

    if _DISTRIBUTED.value:
        # CPU processes (tests, CPU clusters) need a collectives backend; accelerators ignore it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
    from sagm_jax import train

    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    if _DISTRIBUTED.value:
        # Leave together: a process that exits while another still talks to the
        # coordinator (process 0) makes that one abort.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sagm_jax.main finished")
        jax.distributed.shutdown()


if __name__ == "__main__":
    check_overrides(sys.argv)
    app.run(main)
