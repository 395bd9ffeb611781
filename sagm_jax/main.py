"""Entry point: ``python -m sagm_jax.main --config=configs/pacs.py --workdir=DIR``.

``--config.key=value`` overrides a config field; ``--distributed`` calls
``jax.distributed.initialize()`` first (multi-host TPU pods and GPU clusters).
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from sagm_jax.config import check_overrides

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True,
                                          help_string="A configs/*.py file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (results, checkpoints).",
                               required=True)
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "Call jax.distributed.initialize() (one process per host).")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  import jax
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  from sagm_jax import train
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  check_overrides(sys.argv)
  app.run(main)
