"""SAGM on your own image folder: DATA_DIR/<domain>/<class>/<image>, every domain an
environment (sorted folder names), the paper's PACS hyperparameters on ResNet-50.

  python -m sagm_jax.data.verify --dataset=ImageFolder --data_dir=MY_DIR   # counts, decode check
  python -m sagm_jax.main --config=configs/image_folder.py --config.data_dir=MY_DIR \
      --config.pretrained_weights=resnet50-0676ba61.pth --config.test_envs=0

Small folders train faster with fewer steps (``--config.steps=1001``) and ResNet-18
(``--config.arch=resnet18 --config.pretrained_weights=resnet18-f37072fd.pth``).
"""

import os
import runpy


def get_config():
    here = os.path.dirname(os.path.abspath(__file__))
    config = runpy.run_path(os.path.join(here, "pacs.py"))["get_config"]()
    config.dataset = "ImageFolder"
    return config
