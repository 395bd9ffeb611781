"""The checks of single config values: ``check(value, config, device_count) -> None``,
or what was expected (``sagm_jax.config`` adds the key and the value). The generic ones
(integers, numbers in an interval, one of some names, a method hyperparameter's bounds)
and those of particular fields (test environments, MixStyle stages, the MNIST CNN's
widths, the store's short side, rho, the input size, SWAD's tolerance, devices)."""

from __future__ import annotations

from typing import Callable, Sequence

import ml_collections

from sagm_jax.data.registry import DATASETS
from sagm_jax.methods.registry import (  # noqa: F401  (the generic checks: the config's)
    RHO_MAX,
    OneOf,
    bounds,
    integer,
    is_int,
    is_number,
    kind,
    number,
    rule_names,
)
from sagm_jax.models.mnist_cnn import CONV_LAYERS, GROUPNORM_GROUPS
from sagm_jax.models.backbones import BACKBONES
from sagm_jax.models.resnet import MIXSTYLE_STAGES

# A field's check: (value, config, device_count) -> None, or what was expected.
# ``device_count`` is JAX's when known (None before JAX starts).
Check = Callable[[object, ml_collections.ConfigDict, int | None], str | None]


BOOL = kind(bool, "True or False")
TEXT = kind(str, "a string")


def test_envs(value, config, device_count):
    expected = (
        "environment indices (distinct, >= 0), e.g. --config.test_envs=0 or --config.test_envs=0,1 "
        "(or none, --config.test_envs=\"()\": train on every environment, as Model "
        "Ratatouille's auxiliary runs)"
    )
    if not isinstance(value, (tuple, list)):
        return expected
    if not value:
        return None
    if not all(is_int(e) and e >= 0 for e in value) or len(set(value)) != len(value):
        return expected
    spec = DATASETS.get(config.get("dataset"))
    if spec is not None and spec.domains:
        return test_envs_problem(value, config.dataset, spec.domains)


def test_envs_problem(test_envs: Sequence[int], dataset: str, env_names: Sequence[str]):
    """What ``test_envs`` (distinct indices >= 0) should be, for a dataset whose
    environments are ``env_names``: indices among them that leave a training environment.
    The command line checks an image folder's with it once it has listed the folders."""
    envs = ", ".join(f"{i} {name}" for i, name in enumerate(env_names))
    if max(test_envs) >= len(env_names):
        return f"indices of {dataset}'s environments ({envs})"
    if len(test_envs) >= len(env_names):
        return (
            f"a set that leaves a training environment: this one leaves no training "
            f"environment of {dataset}'s {len(env_names)} ({envs})"
        )


def stages(value, config, device_count):
    stages = ", ".join(str(s) for s in MIXSTYLE_STAGES)
    expected = f"distinct ResNet stages among {stages}"
    if not isinstance(value, (tuple, list)) or not all(is_int(s) for s in value):
        return expected
    if len(set(value)) != len(value) or not all(s in MIXSTYLE_STAGES for s in value):
        return expected
    if config.get("mixstyle") is True and not value:
        return expected + " (config.mixstyle=True with no stage is no MixStyle)"


def cnn_widths(value, config, device_count):
    expected = (
        f"{len(CONV_LAYERS)} positive multiples of {GROUPNORM_GROUPS} (GroupNorm's groups), "
        "e.g. 64,128,128,128"
    )
    if not isinstance(value, (tuple, list)) or len(value) != len(CONV_LAYERS):
        return expected
    if not all(is_int(w) and w > 0 and w % GROUPNORM_GROUPS == 0 for w in value):
        return expected


def store_short_side(value, config, device_count):
    if not is_int(value) or value < 1:
        return "a positive integer"
    if is_int(config.get("image_size")) and value < config.image_size:
        return (
            f"an integer >= config.image_size={config.image_size} (a smaller store would "
            "upsample every crop from a downscaled image)"
        )


def rho(value, config, device_count):
    if not is_number(value) or value < 0:
        return "a number >= 0 (the radius of the perturbation)"
    if value > RHO_MAX:
        return (
            f"a number in [0, {RHO_MAX:g}] (the radius of the perturbation; published "
            "radii are 0.01-0.1, ASAM's up to 2)"
        )
    if value == 0 and config.get("algorithm") in rule_names("head"):  # rho 0 is not them
        return f"a number > 0: with rho 0, algorithm={config.algorithm} does not perturb"


# A ResNet halves its input five times (stem, max pool, three strided stages): below
# 32 px its last stage sees less than one pixel.
RESNET_STRIDE = 32


def image_size(value, config, device_count):
    if not is_int(value) or value < 1:
        return "a positive integer"
    backbone = BACKBONES.get(config.get("arch"))
    if backbone is not None and value < backbone.min_image_size:
        what = ("cuts its input into patches of that size" if not backbone.feature_maps
                else "downsamples its input that many times")
        return (
            f"an integer >= {backbone.min_image_size} (config.arch={config.arch} {what}; "
            "the paper uses 224)"
        )


def swad_tolerance(value, config, device_count):
    """A positive integer; where SWAD is on, at least ``swad_n_converge`` (without SWAD
    neither is read, and a tolerance below the convergence count is no problem)."""
    converge = config.get("swad_n_converge")
    if not is_int(value) or value < 1:
        return "a positive integer"
    if config.get("swad") is True and is_int(converge) and value < converge:
        return f"an integer >= config.swad_n_converge={converge} (SWAD's window holds it)"


def num_devices(value, config, device_count):
    if not is_int(value) or value < 0:
        return "an integer >= 0 (0 = every device)"
    if device_count is not None and value > device_count:
        return f"at most the {device_count} device(s) JAX sees (0 = all of them)"


def linear_steps(value, config, device_count):
    """An integer >= 0; above 0 only with an update rule that is an optax chain (a
    procedure updates from its own passes, which the probe does not wrap)."""
    if not is_int(value) or value < 0:
        return "an integer >= 0 (the number of updates of the classifier alone)"
    algorithm = config.get("algorithm")
    if value > 0 and algorithm in rule_names("procedure"):
        return (
            f"0 with config.algorithm={algorithm}: a procedure updates from its own passes, "
            "which the linear probe does not wrap; probe with a plain or sharpness-aware rule"
        )


def moving_average(value, config, device_count):
    """True or False; not with SWAD (a run predicts with one of its averages)."""
    if not isinstance(value, bool):
        return "True or False"
    if value and config.get("swad") is True:
        return (
            "False with config.swad=True: a run predicts with one average, SWAD's or the "
            "moving average; train two runs, or --config.swad=False"
        )


def moving_average_batchnorm_forward(value, config, device_count):
    """True or False; True only where there is an average whose BatchNorm trains."""
    if not isinstance(value, bool):
        return "True or False"
    if value and config.get("moving_average") is not True:
        return "False without config.moving_average=True (it updates the average's statistics)"
    if value and config.get("freeze_batchnorm") is not False:
        return (
            "False with config.freeze_batchnorm=True: ERM++ updates the average's BatchNorm "
            "statistics only where BatchNorm trains (its freeze_bn False); use "
            "--config.freeze_batchnorm=False"
        )


def lr_schedule(value, config, device_count):
    """Factors >= 0 of the learning rate; not with ``lr_plateau`` (which makes them)."""
    expected = "learning-rate factors >= 0, one per evaluation after the linear phase"
    if not isinstance(value, (tuple, list)) or not all(is_number(f) and f >= 0 for f in value):
        return expected
    if value and config.get("lr_plateau") is True:
        return "() with config.lr_plateau=True (the plateau makes the schedule; stage 2 replays it)"
