"""Named presets of a dataset's config: the published protocols beside the paper's.

    python -m sagm_jax.main --config=configs/pacs.py:miro_swag ...

A config file's ``get_config(preset)`` (ml-collections passes the text after ``:``)
returns the paper's SAGM setting, or that setting changed by one preset of
:data:`PRESETS`, for the file's dataset:

* ``domainbed_head``: DomainBed HEAD's protocol (``domainbed/hparams_registry.py``
  defaults, its ``networks.ResNet``): the AugMix ResNet-50 (timm's
  ``resnet50.ram_in1k``, ``resnet50_augmix=True``) with its BatchNorm trained
  (``freeze_bn=False``), lr 5e-5, batch 32, weight decay 0, dropout 0.
* ``miro``: MIRO (``objective=miro``) with its README's searched hyperparameters per
  dataset (khanrc/miro README, "Our searched HPs": lr, dropout, weight decay, lambda).
* ``miro_swad``: MIRO + SWAD as its README's commands run it: its defaults (SWAD's
  ``hparams_registry``: lr 5e-5, batch 32, weight decay 0, dropout 0), lambda per
  dataset, ``swad=True`` (the dataset file's SWAD frequencies: VLCS 50 with tolerance
  ratio 0.2, DomainNet 500).
* ``miro_swag``: "Pushing the limits", MIRO + SWAD on SWAG's RegNetY-16GF at batch 16
  (its README: 77.3% average), lambda 0.01 but DomainNet's 0.1.

* ``erm_plusplus``: ERM++ (DomainBed HEAD's ``ERMPlusPlus`` defaults): ERM, a linear
  probe of 501 updates at linear_lr 5e-5, the moving average from update 600, the AugMix
  ResNet-50 with BatchNorm trained, and the learning-rate plateau of its training script
  (``python -m sagm_jax.averaging.erm_plusplus`` runs both of its stages).

The algorithm stays the file's (SAGM), ``erm_plusplus`` aside (ERM):
``--config.algorithm=erm`` gives the published runs' update rule. Later ``--config.KEY=VALUE`` flags override a preset's values.
"""

from __future__ import annotations

import ml_collections

# khanrc/miro README, "Our searched HPs": dataset -> (lr, dropout, weight decay, lambda).
MIRO_SEARCHED = {
    "PACS": (3e-5, 0.0, 0.0, 0.01),
    "VLCS": (1e-5, 0.5, 1e-6, 0.01),
    "OfficeHome": (3e-5, 0.1, 1e-6, 0.1),
    "TerraIncognita": (3e-5, 0.0, 1e-4, 0.1),
    "DomainNet": (3e-5, 0.1, 0.0, 0.1),
}
# The README's MIRO + SWAD lambda per dataset, and with SWAG's RegNetY-16GF.
MIRO_SWAD_LD = {"PACS": 0.01, "VLCS": 0.01, "OfficeHome": 0.1, "TerraIncognita": 0.1,
                "DomainNet": 0.1}
MIRO_SWAG_LD = {"PACS": 0.01, "VLCS": 0.01, "OfficeHome": 0.01, "TerraIncognita": 0.01,
                "DomainNet": 0.1}


def _domainbed_defaults(config):
    """DomainBed's (and SWAD's) default lr, batch, weight decay and dropout for images."""
    config.lr, config.batch_per_env, config.weight_decay, config.dropout = 5e-5, 32, 0.0, 0.0


def _domainbed_head(config):
    _domainbed_defaults(config)
    config.arch, config.freeze_batchnorm = "resnet50_augmix", False


def _miro(config):
    config.objective = "miro"
    config.lr, config.dropout, config.weight_decay, config.miro_ld = _table(
        MIRO_SEARCHED, config.dataset, "miro")


def _miro_swad(config):
    _domainbed_defaults(config)
    config.objective, config.swad = "miro", True
    config.miro_ld = _table(MIRO_SWAD_LD, config.dataset, "miro_swad")


def _miro_swag(config):
    _miro_swad(config)
    config.arch, config.batch_per_env = "swag_regnety_16gf", 16
    config.miro_ld = _table(MIRO_SWAG_LD, config.dataset, "miro_swag")


# ERM++'s defaults (facebookresearch/DomainBed domainbed/hparams_registry.py, the
# unconditional block and ERMPlusPlus's): linear_steps 500 (its update runs 501 linear
# updates: ``global_iter > linear_steps`` counts the updates before, linear_probe's doc),
# linear_lr 5e-5; the moving average from update 600 (lib/misc.py ErmPlusPlusMovingAvg's
# sma_start_iter); freeze_bn False, lars False.
ERM_PLUSPLUS_LINEAR_STEPS, ERM_PLUSPLUS_LINEAR_LR, ERM_PLUSPLUS_AVERAGE_START = 500, 5e-5, 600


def _erm_plusplus(config):
    """ERM++ (stage 1 of its training script, the learning-rate plateau on; the two
    stages: ``sagm_jax.averaging.erm_plusplus``). Images: the AugMix ResNet-50 with its
    BatchNorm trained and the moving average's statistics updated by a training forward
    of each step's batch, lr 5e-5, batch 32, weight decay 0, dropout 0. The MNIST CNN
    (GroupNorm: no BatchNorm) keeps the file's small-image settings (DomainBed's
    SMALL_IMAGES lr 1e-3, batch 64, weight decay 0)."""
    if config.arch != "mnist_cnn":
        _domainbed_head(config)
        config.moving_average_batchnorm_forward = True
    config.algorithm, config.objective = "erm", "erm"
    config.linear_steps, config.linear_lr = ERM_PLUSPLUS_LINEAR_STEPS + 1, ERM_PLUSPLUS_LINEAR_LR
    config.moving_average, config.moving_average_start = True, ERM_PLUSPLUS_AVERAGE_START
    config.lr_plateau = True


def _table(table, dataset, preset):
    if dataset not in table:
        raise ValueError(f"config preset {preset!r} is published for {', '.join(table)}; "
                         f"not for {dataset}.")
    return table[dataset]


PRESETS = {
    "domainbed_head": _domainbed_head,
    "miro": _miro,
    "miro_swad": _miro_swad,
    "miro_swag": _miro_swag,
    "erm_plusplus": _erm_plusplus,
}


def apply(config: ml_collections.ConfigDict, preset: str | None) -> ml_collections.ConfigDict:
    """``config`` changed by ``preset`` (None or "" leaves it as it is); an unknown name
    is a ValueError naming the presets."""
    if not preset:
        return config
    if preset not in PRESETS:
        raise ValueError(f"config preset {preset!r}: expected one of {', '.join(PRESETS)} "
                         "(--config=configs/DATASET.py:PRESET).")
    PRESETS[preset](config)
    return config
