"""SAGM on TerraIncognita with the paper's hyperparameters (ResNet-50 from ImageNet weights).

  python -m sagm_jax.main --config=configs/terra_incognita.py --workdir=runs/terra_incognita \
      --config.data_dir=DATA_DIR --config.pretrained_weights=resnet50-0676ba61.pth
"""

from sagm_jax.config import presets, resnet50_config


def get_config(preset=None):
    config = resnet50_config("TerraIncognita")  # ResNet-50 from ImageNet, dropout 0.5, rho 0.05, SAGM
    # The paper's hyperparameters for TerraIncognita (docs/protocol.md):
    config.lr = 1e-5
    config.weight_decay = 1e-4
    config.alpha = 1e-3  # SAGM's alpha
    config.miro_ld = 0.1  # MIRO's lambda (khanrc/miro README), with --config.objective=miro
    config.steps = 5001
    return presets.apply(config, preset)  # configs/DATASET.py:PRESET (sagm_jax.config.presets)
