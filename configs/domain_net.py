"""SAGM on DomainNet with the paper's hyperparameters (ResNet-50 from ImageNet weights).

  python -m sagm_jax.main --config=configs/domain_net.py --workdir=runs/domain_net \
      --config.data_dir=DATA_DIR --config.pretrained_weights=resnet50-0676ba61.pth
"""

from sagm_jax.config import presets, resnet50_config


def get_config(preset=None):
    config = resnet50_config("DomainNet")  # ResNet-50 from ImageNet, dropout 0.5, rho 0.05, SAGM
    # The paper's hyperparameters for DomainNet (docs/protocol.md):
    config.lr = 3e-5
    config.weight_decay = 1e-6
    config.alpha = 5e-4  # SAGM's alpha
    config.miro_ld = 0.1  # MIRO's lambda (khanrc/miro README), with --config.objective=miro
    config.steps = 15001
    config.swad_eval_every = 500  # SWAD's DomainNet frequency, used with --config.swad=True
    return presets.apply(config, preset)  # configs/DATASET.py:PRESET (sagm_jax.config.presets)
