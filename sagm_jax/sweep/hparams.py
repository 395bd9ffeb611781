"""DomainBed's random hyperparameter search: which hyperparameters a method and dataset
draw, from which distributions, and how each draw is seeded.

:func:`random_hparams` ``(algorithm, dataset, hparams_seed, trial_seed, objective)``
returns OUR config keys (``batch_per_env``, ``dropout``, ``fish_meta_lr``, ...).

* ``hparams_seed`` 0 is the defaults, in DomainBed's meaning: DomainBed's default of each
  hyperparameter it draws (ResNet datasets lr 5e-5, batch 32, weight decay 0, dropout 0;
  MNIST lr 1e-3, batch 64, weight decay 0), NOT the paper's per-dataset values that
  ``configs/<dataset>.py`` carry (``--hparams paper`` runs those).
* Otherwise, with DomainBed's ``misc.seed_hash``
  ``seed_hash(*a) = int(md5(str(a)), 16) mod 2^31`` (``str`` of the argument tuple, so
  ``seed_hash(3, 0)`` hashes ``"(3, 0)"`` and ``seed_hash(s, 'lr')`` hashes
  ``"(s, 'lr')"``), ``s = seed_hash(hparams_seed, trial_seed)`` and each hyperparameter
  named ``name`` in DomainBed takes the FIRST draw of
  ``numpy.random.RandomState(seed_hash(s, name))`` from its distribution. Each name has
  its own generator, so the draws do not depend on which other names are drawn, nor in
  which order: the same (algorithm, dataset, hparams_seed, trial_seed) gives DomainBed's
  values (its ``hparams_registry`` since 2020-10-20).

The shared distributions (DomainBed's ``domainbed/hparams_registry.py``, ``_hparams``;
DomainBed's ``SMALL_IMAGES`` are its MNIST datasets, here with RotatedDigits, which runs the
same CNN; DomainBed draws ``resnet_dropout`` for them too, unused, and since every name has
its own generator, leaving that draw out changes no other):

=================  ===============================  =============================
DomainBed name     ResNet datasets                  MNIST-like datasets
=================  ===============================  =============================
lr                 5e-5; 10^U(-5, -3.5)             1e-3; 10^U(-4.5, -2.5)
batch_size         32; int(2^U(3, 5.5)),            64; int(2^U(3, 9))
                   DomainNet int(2^U(3, 5));
                   ARM fixed 8 (default and draws)
weight_decay       0; 10^U(-6, -2)                  0; fixed 0
resnet_dropout     0; choice {0, 0.1, 0.5}          not drawn (no ResNet)
=================  ===============================  =============================

DomainBed's newer ``hparams_registry.py`` (the one with its ViT and DINOv2 backbones)
defines more names for every algorithm and dataset, none of which is drawn here:
``vit_dropout`` (0; choice {0, 0.1, 0.5}), read only by its ViT/DINOv2 featurizers,
and the fixed flags ``resnet50_augmix`` True (its ``networks.ResNet`` then loads timm's
``resnet50.ram_in1k`` weights instead of torchvision's ImageNet ResNet-50),
``freeze_bn`` False (its ResNet then trains the BatchNorm statistics), ``dinov2``,
``vit``, ``vit_attn_tune`` and ``lars`` False and ``linear_steps`` 500, beside the older
fixed ``data_augmentation`` True, ``resnet18``, ``class_balanced`` and
``nonlinear_classifier`` False. Our default is the setting the SAGM paper (and SWAD,
whose code it builds on) ran, DomainBed's earlier one: torchvision's ImageNet weights
(``pretrained_weights``, ``sagm_jax.models.torchvision_weights``) and BatchNorm frozen
(``freeze_batchnorm=True``; DomainBed's ResNet froze it always before ``freeze_bn``
existed); DomainBed HEAD's fixed flags are the config preset ``domainbed_head``
(``sagm_jax.config.presets``: ``arch=resnet50_augmix``, ``freeze_batchnorm=False``).
On a ViT (``arch`` ``dinov2_vitb14`` or ``clip_vit-b16``) the head's dropout is
DomainBed's ``vit_dropout``: the same distribution, drawn under that name (pass
``arch``). As each name has its own generator, leaving the other draws out changes none
of the draws we make.

DiWA's search space (``space="diwa"``, :func:`diwa_hparams`): the "mild" ranges of
alexrame/diwa's ``domainbed/hparams_registry.py`` (its ``## DiWA ##`` block, SWAD's ranges),
which replace the shared lr, weight_decay and batch_size on EVERY dataset (the reference
comments out its per-dataset ones, MNIST's included), drawn and seeded as above (its
``train.py`` passes ``seed_hash(hparams_seed, trial_seed)``; its ``_hparam`` seeds each
name's own ``RandomState``); the method's own hyperparameters are drawn as in DomainBed's
space:

=================  ===============================================================
DiWA name          default; draw (every dataset)
=================  ===============================================================
lr                 5e-5; choice {1e-5, 3e-5, 5e-5}
weight_decay       0; choice {1e-4, 1e-6}
batch_size         32; fixed 32 (ARM's and MNIST's included)
resnet_dropout     0; choice {0, 0.1, 0.5} (not drawn on the MNIST-like datasets)
=================  ===============================================================

Each objective's and update rule's own hyperparameters are drawn from the
``Distribution`` of its registry entry in :mod:`sagm_jax.methods` (DomainBed's), under
DomainBed's name (:data:`DOMAINBED_NAMES`). DomainBed has no sharpness-aware method; OUR
draws (the heads' entries in ``sagm_jax.methods.update_rules``) are: ``rho`` fixed 0.05
for every head (SAGM's DomainBed runs fix it), SAGM's ``alpha`` from the paper's search
{1e-3, 5e-4}, GSAM's ``gsam_alpha`` fixed at its default; DISAM's ``disam_lambda`` (when DISAM is on) from 10^U(-2, 0) around its code's default 0.1, the
default being the lambda the caller gives. Keys without a distribution (CutMix's) are
not returned: the config's values stay.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sagm_jax import methods
from sagm_jax.data import registry
from sagm_jax.models.backbones import BACKBONES
from sagm_jax.methods.registry import Hyperparameter, choice, fixed, log_uniform

# Our config key -> DomainBed's hyperparameter name, where they differ; the name seeds
# the draw, so it must be DomainBed's.
DOMAINBED_NAMES = {
    "batch_per_env": "batch_size",
    "dropout": "resnet_dropout",
    "fish_meta_lr": "meta_lr",
    "and_mask_tau": "tau",
    "mldg_n_meta_test": "n_meta_test",
    "dann_lambda": "lambda",
    "fishr_lambda": "lambda",
    "fishr_penalty_anneal_iters": "penalty_anneal_iters",
    "fishr_ema": "ema",
    "trm_cos_lambda": "cos_lambda",
    "trm_iters": "iters",
    "iga_penalty": "penalty",
    "rdm_variance_weight": "variance_weight",
    "adrmx_d_steps_per_g_step": "d_steps_per_g_step",
    "adrmx_mlp_depth": "mlp_depth",
    "sand_mask_tau": "tau",
    "sand_mask_k": "k",
    "transfer_t_lambda": "t_lambda",
    "transfer_delta": "delta",
    "transfer_d_steps_per_g": "d_steps_per_g",
    "transfer_weight_decay_d": "weight_decay_d",
    "transfer_gda": "gda",
    "transfer_beta1": "beta1",
    "transfer_lr_d": "lr_d",
}
# DomainBed's other defaults and draws on its SMALL_IMAGES (DANN's and CDANN's).
MNIST_METHOD_HPARAMS = {
    "lr_g": (1e-3, log_uniform(-4.5, -2.5)),
    "lr_d": (1e-3, log_uniform(-4.5, -2.5)),
    "weight_decay_g": (0.0, fixed(0.0)),
}

DISAM_DRAW = log_uniform(-2, 0)
# The search spaces of :func:`random_hparams`: DomainBed's, DiWA's mild ranges, EoA's.
SPACES = ("domainbed", "diwa", "eoa")
# The backbones whose head dropout DomainBed calls ``vit_dropout`` (no feature maps).
VIT_ARCHS = tuple(name for name, b in BACKBONES.items() if not b.feature_maps)
# DomainBed's ``batch_size`` of an objective outside SMALL_IMAGES, default and every draw:
# ARM's 8 (its ``hparams_registry``: ``elif algorithm == 'ARM'``, before DomainNet's).
FIXED_IMAGE_BATCH = {"arm": 8}


def seed_hash(*args) -> int:
    """DomainBed's ``misc.seed_hash``: the md5 of ``str(args)``, mod 2^31."""
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % 2**31


def is_mnist_like(dataset: str) -> bool:
    """DomainBed's ``SMALL_IMAGES`` (RotatedMNIST, ColoredMNIST) and our RotatedDigits:
    the in-memory datasets, trained with the MNIST CNN."""
    return registry.get_spec(dataset).kind == "array"


def shared_hparams(dataset: str, objective: str = "erm") -> tuple[Hyperparameter, ...]:
    """lr, batch_per_env, weight_decay and dropout of ``dataset`` with DomainBed's
    defaults and distributions (the module's table); ``batch_per_env`` fixed at
    :data:`FIXED_IMAGE_BATCH` for its objectives (ARM's 8) outside the MNIST-like ones."""
    if is_mnist_like(dataset):
        return (
            Hyperparameter("lr", 1e-3, "", "", log_uniform(-4.5, -2.5)),
            Hyperparameter("batch_per_env", 64, "", "", log_uniform(3, 9, integer=True, base=2)),
            Hyperparameter("weight_decay", 0.0, "", "", fixed(0.0)),
        )
    high = 5 if dataset == "DomainNet" else 5.5
    batch = Hyperparameter("batch_per_env", 32, "", "", log_uniform(3, high, integer=True, base=2))
    if objective in FIXED_IMAGE_BATCH:
        size = FIXED_IMAGE_BATCH[objective]
        batch = batch._replace(default=size, distribution=fixed(size))
    return (
        Hyperparameter("lr", 5e-5, "", "", log_uniform(-5, -3.5)),
        batch,
        Hyperparameter("weight_decay", 0.0, "", "", log_uniform(-6, -2)),
        Hyperparameter("dropout", 0.0, "", "", choice((0.0, 0.1, 0.5))),
    )


def diwa_shared_hparams(dataset: str) -> tuple[Hyperparameter, ...]:
    """lr, batch_per_env, weight_decay (and dropout, but on the MNIST-like datasets, whose
    CNN has none) with DiWA's defaults and mild distributions (alexrame/diwa
    ``domainbed/hparams_registry.py``, ``## DiWA ##``: the same on every dataset)."""
    shared = (
        Hyperparameter("lr", 5e-5, "", "", choice((1e-5, 3e-5, 5e-5))),
        Hyperparameter("batch_per_env", 32, "", "", fixed(32)),
        Hyperparameter("weight_decay", 0.0, "", "", choice((1e-4, 1e-6))),
        Hyperparameter("dropout", 0.0, "", "", choice((0.0, 0.1, 0.5))),
    )
    return shared[:3] if is_mnist_like(dataset) else shared


def eoa_shared_hparams(dataset: str) -> tuple[Hyperparameter, ...]:
    """lr, batch_per_env, weight_decay (and dropout, but on the MNIST-like datasets) of
    EoA's experiments (salesforce/ensemble-of-averages ``domainbed/hparams_registry.py``,
    "hyper-params used in our experiments", on every dataset): lr 5e-5 and batch 32
    fixed, weight decay 10^U(-6, -4) (default 0), DomainBed's dropout."""
    shared = (
        Hyperparameter("lr", 5e-5, "", "", fixed(5e-5)),
        Hyperparameter("batch_per_env", 32, "", "", fixed(32)),
        Hyperparameter("weight_decay", 0.0, "", "", log_uniform(-6, -4)),
        Hyperparameter("dropout", 0.0, "", "", choice((0.0, 0.1, 0.5))),
    )
    return shared[:3] if is_mnist_like(dataset) else shared


def searched_hparams(
    algorithm: str, dataset: str, objective: str = "erm", disam_lambda: float = 0.0,
    space: str = "domainbed",
) -> tuple[Hyperparameter, ...]:
    """Every hyperparameter the search draws for the method and dataset, each with its
    default and distribution: the shared ones (DiWA's with ``space="diwa"``, which then
    win over a method's per-dataset ones), the objective's, the update rule's, and
    DISAM's when ``disam_lambda`` > 0 (its default then)."""
    own = [
        *methods.OBJECTIVES[objective].method.hyperparameters,
        *methods.UPDATE_RULES[algorithm].method.hyperparameters,
    ]
    if disam_lambda > 0:
        own.append(methods.DISAM._replace(default=float(disam_lambda), distribution=DISAM_DRAW))
    if is_mnist_like(dataset):
        own = [h._replace(default=MNIST_METHOD_HPARAMS[h.key][0],
                          distribution=MNIST_METHOD_HPARAMS[h.key][1])
               if h.key in MNIST_METHOD_HPARAMS else h for h in own]
    changed = dataset_hparams(algorithm, dataset, objective)
    shared = shared_hparams(dataset, objective)
    if space in ("diwa", "eoa"):
        shared = (diwa_shared_hparams if space == "diwa" else eoa_shared_hparams)(dataset)
        changed = {k: v for k, v in changed.items() if k not in {h.key for h in shared}}
    return tuple(
        h._replace(default=changed[h.key][0], distribution=changed[h.key][1])
        if h.key in changed else h
        for h in shared + tuple(own)
        if h.distribution is not None or h.key in changed
    )


def dataset_hparams(algorithm: str, dataset: str, objective: str = "erm") -> dict:
    """``{config key: (default, Distribution)}`` that the objective's and the update
    rule's registry entries give on ``dataset`` (``Method.by_dataset``: DomainBed's
    per-dataset defaults and draws, RDM's and ADRMX's), the update rule's last."""
    changed = {}
    for entry in (methods.OBJECTIVES[objective], methods.UPDATE_RULES[algorithm]):
        if entry.method.by_dataset is not None:
            changed.update(entry.method.by_dataset(dataset, is_mnist_like(dataset)))
    return changed


def random_hparams(
    algorithm: str,
    dataset: str,
    hparams_seed: int,
    trial_seed: int,
    objective: str = "erm",
    disam_lambda: float = 0.0,
    arch: str | None = None,
    space: str = "domainbed",
) -> dict:
    """``{config key: value}`` of setting ``hparams_seed`` (0 = DomainBed's defaults) for
    the update rule ``algorithm`` with ``objective`` (and DISAM at ``disam_lambda`` > 0,
    its setting-0 value) on ``dataset``, drawn as DomainBed draws (module docstring);
    on a ViT ``arch`` the dropout under DomainBed's name ``vit_dropout``. ``space``
    (:data:`SPACES`) "diwa" draws the shared keys from DiWA's mild ranges instead, "eoa"
    from EoA's experiments' (:func:`eoa_shared_hparams`).

    >>> random_hparams("erm", "PACS", 0, 0)
    {'lr': 5e-05, 'batch_per_env': 32, 'weight_decay': 0.0, 'dropout': 0.0}
    """
    for name, table in (("algorithm", methods.UPDATE_RULES), ("objective", methods.OBJECTIVES)):
        value = algorithm if name == "algorithm" else objective
        if value not in table:
            raise ValueError(f"{name} {value!r}: expected one of {', '.join(table)}.")
    problem = methods.combination_problem(objective, algorithm, float(disam_lambda))
    if problem:
        raise ValueError(problem)
    if not (isinstance(hparams_seed, int) and hparams_seed >= 0):
        raise ValueError(f"hparams_seed {hparams_seed!r}: expected an integer >= 0.")
    if space not in SPACES:
        raise ValueError(f"search space {space!r}: expected one of {', '.join(SPACES)}.")
    hparams = searched_hparams(algorithm, dataset, objective, disam_lambda, space)
    if hparams_seed == 0:
        return {h.key: h.default for h in hparams}
    setting = seed_hash(hparams_seed, trial_seed)
    names = dict(DOMAINBED_NAMES)
    if arch in VIT_ARCHS:
        names["dropout"] = "vit_dropout"
    return {
        h.key: h.distribution.draw(
            np.random.RandomState(seed_hash(setting, names.get(h.key, h.key)))
        )
        for h in hparams
    }


def diwa_hparams(
    dataset: str,
    hparams_seed: int,
    trial_seed: int,
    algorithm: str = "erm",
    objective: str = "erm",
    disam_lambda: float = 0.0,
    arch: str | None = None,
) -> dict:
    """A member's setting in DiWA's search (alexrame/diwa: ``hparams_registry._hparams``'
    ``## DiWA ##`` block, seeded as its ``train.py``): :func:`random_hparams` with
    ``space="diwa"``; ``hparams_seed`` 0 is its defaults.

    >>> diwa_hparams("PACS", 0, 0)
    {'lr': 5e-05, 'batch_per_env': 32, 'weight_decay': 0.0, 'dropout': 0.0}
    """
    return random_hparams(algorithm, dataset, hparams_seed, trial_seed, objective,
                          disam_lambda, arch, space="diwa")
