"""SAGM on VLCS with the paper's hyperparameters (ResNet-50 from ImageNet weights).

  python -m sagm_jax.main --config=configs/vlcs.py --workdir=runs/vlcs \
      --config.data_dir=DATA_DIR --config.pretrained_weights=resnet50-0676ba61.pth
"""

from sagm_jax.config import presets, resnet50_config


def get_config(preset=None):
    config = resnet50_config("VLCS")  # ResNet-50 from ImageNet, dropout 0.5, rho 0.05, SAGM
    # The paper's hyperparameters for VLCS (docs/protocol.md):
    config.lr = 1e-5
    config.weight_decay = 1e-4
    config.alpha = 1e-3  # SAGM's alpha
    config.miro_ld = 0.01  # MIRO's lambda (khanrc/miro README), with --config.objective=miro
    config.steps = 5001
    # SWAD's VLCS setting (khanrc/swad's README command), used with --config.swad=True.
    config.swad_eval_every, config.swad_tolerance_ratio = 50, 0.2
    return presets.apply(config, preset)  # configs/DATASET.py:PRESET (sagm_jax.config.presets)
