"""RegNetY checkpoints: their key layouts, and mapping them onto ``regnet.RegNet``.

This module owns the step from a RegNetY-16GF weights file to our variables. Two
layouts of the same tensors are read:

* torchvision's (``regnet_y_16gf().state_dict()``, and its SWAG weights
  ``RegNet_Y_16GF_Weights.IMAGENET1K_SWAG_LINEAR_V1`` / ``IMAGENET1K_SWAG_E2E_V1``):
  ``stem.0.weight``, ``stem.1.*`` (BN), then per block
  ``trunk_output.block{i}.block{i}-{j}.`` + ``proj.0.weight``, ``proj.1.*``,
  ``f.a.0.weight``, ``f.a.1.*``, ``f.b.0.weight``, ``f.b.1.*``,
  ``f.se.fc1.{weight,bias}``, ``f.se.fc2.{weight,bias}``, ``f.c.0.weight``,
  ``f.c.1.*``, and the classifier ``fc.{weight,bias}``;
* SWAG's own (torch.hub ``facebookresearch/swag``, ``regnety_16gf`` and
  ``regnety_16gf_in1k``; ClassyVision's RegNet, ``SWAG/models/regnet.py``), the
  same tensors under other names: ``stem.stem.0.weight``, ``stem.stem.1.*``, and per
  block ``proj.weight``, ``bn.*``, ``f.a.*``, ``f.b.*``,
  ``f.se.excitation.0.{weight,bias}``, ``f.se.excitation.2.{weight,bias}``,
  ``f.c.weight``, ``f.final_bn.*``, and the classifier (``_in1k`` only)
  ``head.fc.{weight,bias}``.

``regnet_layout`` lists torchvision's keys in its ``state_dict()`` order with their
shapes and our variable paths; ``swag_key`` renames a torchvision key to SWAG's.
``convert_regnet(state_dict)`` strips a ``module.`` prefix (DataParallel's), reads
the layout from the keys, and maps the weights strictly (``convert_layout``: a
missing, unexpected or mis-shaped key is a ValueError naming it; float16 becomes
float32; ``*.num_batches_tracked`` is ignored). The classifier (``fc.*`` or
``head.fc.*``) becomes ``params['classifier']``, the ImageNet head that
``with_pretrained_backbone`` drops as DomainBed and MIRO do; a checkpoint without
one (SWAG's ``regnety_16gf``, MIRO's trunk) converts to the backbone alone.

Layouts: conv weights [out, in / groups, kh, kw] become kernels [kh, kw, in / groups,
out] (the SE layers' 1x1 convs alike), the classifier [out, in] a kernel [in, out].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sagm_jax.models.regnet import (
    REGNET_Y_16GF,
    SE_RATIO,
    STEM_WIDTH,
    BlockParams,
    squeeze_width,
)
from sagm_jax.models.torchvision_weights import LayoutEntry, convert_layout

PREFIXES = ("module.",)
# A key both layouts have (after the prefix): a RegNet's first block's first conv.
SIGNATURE = "trunk_output.block1.block1-0.f.a.0.weight"
# Names only SWAG's layout has: its stem's inner Sequential and its blocks' last BN.
SWAG_STEM_PREFIX = "stem.stem."
SWAG_BN = ".f.final_bn."


def _conv(torch_key: str, path: tuple[str, ...], shape: tuple[int, ...]) -> list[LayoutEntry]:
    return [LayoutEntry(torch_key, shape, "params", path + ("kernel",), "conv")]


def _bn(torch_module: str, path: tuple[str, ...], channels: int) -> list[LayoutEntry]:
    names = (
        ("weight", "params", "scale"),
        ("bias", "params", "bias"),
        ("running_mean", "batch_stats", "mean"),
        ("running_var", "batch_stats", "var"),
    )
    return [
        LayoutEntry(f"{torch_module}.{key}", (channels,), collection, path + (name,), "vector")
        for key, collection, name in names
    ]


def _block_entries(
    stage: int,
    index: int,
    width_in: int,
    width: int,
    group_width: int,
    multiplier: float,
    se_ratio: float,
) -> list[LayoutEntry]:
    """One ``ResBottleneckBlock``'s entries, in torchvision's order."""
    torch_block = f"trunk_output.block{stage}.block{stage}-{index}"
    ours = (f"block{stage}_{index}",)
    stride = 2 if index == 0 else 1
    w_b = round(width * multiplier)
    entries = []
    if width_in != width or stride != 1:
        entries += _conv(
            f"{torch_block}.proj.0.weight", ours + ("proj_conv",), (width, width_in, 1, 1)
        )
        entries += _bn(f"{torch_block}.proj.1", ours + ("proj_bn",), width)
    entries += _conv(f"{torch_block}.f.a.0.weight", ours + ("a_conv",), (w_b, width_in, 1, 1))
    entries += _bn(f"{torch_block}.f.a.1", ours + ("a_bn",), w_b)
    entries += _conv(f"{torch_block}.f.b.0.weight", ours + ("b_conv",), (w_b, group_width, 3, 3))
    entries += _bn(f"{torch_block}.f.b.1", ours + ("b_bn",), w_b)
    if se_ratio:
        squeeze = squeeze_width(width_in, se_ratio)
        for fc, shape in (("fc1", (squeeze, w_b)), ("fc2", (w_b, squeeze))):
            key, path = f"{torch_block}.f.se.{fc}", ours + ("se", fc)
            entries += _conv(f"{key}.weight", path, shape + (1, 1))
            entries.append(
                LayoutEntry(f"{key}.bias", shape[:1], "params", path + ("bias",), "vector")
            )
    entries += _conv(f"{torch_block}.f.c.0.weight", ours + ("c_conv",), (width, w_b, 1, 1))
    entries += _bn(f"{torch_block}.f.c.1", ours + ("c_bn",), width)
    return entries


def regnet_layout(
    num_classes: int | None = 1000,
    params: BlockParams = REGNET_Y_16GF,
    se_ratio: float = SE_RATIO,
    stem_width: int = STEM_WIDTH,
    input_channels: int = 3,
) -> list[LayoutEntry]:
    """torchvision's ``RegNet.state_dict()`` keys for ``params`` (RegNetY-16GF's by
    default), in its order, without counters; no classifier when ``num_classes`` is
    None."""
    entries = _conv("stem.0.weight", ("conv1",), (stem_width, input_channels, 3, 3))
    entries += _bn("stem.1", ("bn1",), stem_width)
    width_in = stem_width
    stages = zip(params.depths, params.widths, params.group_widths, params.bottleneck_multipliers)
    for stage, (depth, width, group_width, multiplier) in enumerate(stages, start=1):
        for index in range(depth):
            block_in = width_in if index == 0 else width
            entries += _block_entries(
                stage, index, block_in, width, group_width, multiplier, se_ratio
            )
        width_in = width
    if num_classes is not None:
        entries += [
            LayoutEntry(
                "fc.weight", (num_classes, width_in), "params", ("classifier", "kernel"), "linear"
            ),
            LayoutEntry("fc.bias", (num_classes,), "params", ("classifier", "bias"), "vector"),
        ]
    return entries


# torchvision's key parts -> SWAG's (ClassyVision's), applied in this order.
_SWAG_RENAMES = (
    ("stem.0.", "stem.stem.0."),
    ("stem.1.", "stem.stem.1."),
    (".proj.0.", ".proj."),
    (".proj.1.", ".bn."),
    (".f.se.fc1.", ".f.se.excitation.0."),
    (".f.se.fc2.", ".f.se.excitation.2."),
    (".f.c.0.", ".f.c."),
    (".f.c.1.", ".f.final_bn."),
)


def swag_key(torch_key: str) -> str:
    """torchvision's RegNet key ``torch_key`` under SWAG's (ClassyVision's) names."""
    if torch_key.startswith("fc."):
        return "head." + torch_key
    for old, new in _SWAG_RENAMES:
        if old.startswith("stem."):
            if torch_key.startswith(old):
                return new + torch_key[len(old) :]
        elif old in torch_key:
            return torch_key.replace(old, new)
    return torch_key


def strip_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without a ``module.`` prefix that all of its keys carry."""
    for prefix in PREFIXES:
        if state_dict and all(key.startswith(prefix) for key in state_dict):
            return {key[len(prefix) :]: value for key, value in state_dict.items()}
    return dict(state_dict)


def detect_regnet(state_dict: Mapping[str, Any]) -> bool:
    """Whether the keys are a RegNet's (torchvision's or SWAG's layout)."""
    return SIGNATURE in strip_prefix(state_dict)


def convert_regnet(state_dict: Mapping[str, Any], image_size: int = 224) -> dict[str, dict]:
    """Map a RegNetY-16GF state dict (torchvision's or SWAG's layout, see the module
    docstring) onto ``{'params': ..., 'batch_stats': ...}``, strictly.

    The classifier's width is read from ``fc.weight`` / ``head.fc.weight``; without
    either the result has no ``classifier``. ``image_size`` is accepted for the common
    interface (no RegNet parameter depends on it).
    """
    del image_size
    weights = strip_prefix(state_dict)
    swag = any(key.startswith(SWAG_STEM_PREFIX) or SWAG_BN in key for key in weights)
    fc = weights.get("head.fc.weight" if swag else "fc.weight")
    num_classes = int(np.shape(fc)[0]) if fc is not None and np.ndim(fc) == 2 else None
    if num_classes is None and any(key.startswith(("fc.", "head.")) for key in weights):
        num_classes = 1000  # a malformed head: let the strict check name its keys
    layout = regnet_layout(num_classes)
    description = "torchvision regnet_y_16gf"
    if swag:
        layout = [
            LayoutEntry(swag_key(e.torch_key), e.shape, e.collection, e.path, e.kind)
            for e in layout
        ]
        description = "SWAG regnety_16gf"
    return convert_layout(weights, layout, description)
