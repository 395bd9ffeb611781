"""SAGM on PACS with the paper's hyperparameters (ResNet-50 from ImageNet weights).

  python -m sagm_jax.main --config=configs/pacs.py --workdir=runs/pacs \
      --config.data_dir=DATA_DIR --config.pretrained_weights=resnet50-0676ba61.pth
"""

from sagm_jax.config import paper_config


def get_config():
    return paper_config("PACS")
