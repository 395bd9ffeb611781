"""CLIP ResNet image-tower checkpoints: their layout, conversion and detection.

This module owns the mapping between open_clip's ``ModifiedResNet.state_dict()`` (the
keys of ``open_clip.create_model('RN50').visual``, which are also OpenAI's
``clip/model.py`` keys under ``visual.``) and the variables of
``clip_resnet.CLIPResNet``:

* ``clip_resnet_layout(...)`` lists the reference's keys in its ``state_dict()`` order,
  with their shapes and our variable paths: the stem ``conv1..3`` / ``bn1..3``; each
  block ``layer{s}.{i}.conv1..3`` / ``bn1..3`` and, in a stage's first block,
  ``downsample.0`` (the 1x1 convolution) and ``downsample.1`` (its BatchNorm) -- the
  reference's ``AvgPool2d`` in that branch is registered as ``downsample.-1`` and holds
  no weights; then ``attnpool.positional_embedding`` [(image_size / 32)^2 + 1, 32w] and
  ``attnpool.{k,q,v,c}_proj.{weight,bias}``.
* ``convert_clip_resnet(state_dict, image_size)`` maps such a state dict onto
  ``{'params': ..., 'batch_stats': ...}`` strictly (``torchvision_weights.convert_layout``:
  a missing, unexpected or mis-shaped key is an error naming it; BatchNorm's
  ``num_batches_tracked`` counters are ignored; float16 arrays become float32). It also
  takes a full CLIP model's state dict (open_clip's or OpenAI's): the image tower's keys
  are those under ``visual.``, and every other key -- the text tower (``transformer.*``,
  ``token_embedding.weight``, ``positional_embedding``, ``ln_final.*``,
  ``text_projection``) and ``logit_scale``, plus the metadata entries of OpenAI's JIT
  archives (``input_resolution``, ``context_length``, ``vocab_size``) -- is ignored. A
  ``module.`` prefix (a DataParallel save) is stripped first. CLIP has no classifier:
  the converted variables have no ``classifier``, and ``with_pretrained_backbone`` keeps
  the fresh one.
* ``detect_clip_resnet(state_dict)``: whether the keys are this family's.

Layouts: torch convolution weights [out, in, kh, kw] become kernels [kh, kw, in, out],
linear weights [out, in] kernels [in, out]; BatchNorm ``weight``/``bias`` are our
``scale``/``bias`` and ``running_mean``/``running_var`` our ``mean``/``var``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sagm_jax.models.clip_resnet import EXPANSION, FEATURE_DIM, LAYERS, WIDTH
from sagm_jax.models.torchvision_weights import (
    LayoutEntry,
    _bn_entries,
    _conv_entries,
    convert_layout,
)

VISUAL_PREFIX = "visual."
STRIPPED_PREFIXES = ("module.",)
POSITIONAL_KEY = "attnpool.positional_embedding"


def clip_resnet_layout(
    image_size: int = 224,
    layers: Sequence[int] = LAYERS,
    width: int = WIDTH,
    output_dim: int = FEATURE_DIM,
) -> list[LayoutEntry]:
    """The reference ``ModifiedResNet.state_dict()`` keys (without counters), in order."""
    half = width // 2
    entries = []
    for index, (out_ch, in_ch) in enumerate(((half, 3), (half, half), (width, half)), start=1):
        entries += _conv_entries(f"conv{index}", (f"conv{index}",), out_ch, in_ch, 3)
        entries += _bn_entries(f"bn{index}", (f"bn{index}",), out_ch)
    in_ch = width
    for stage, blocks in enumerate(layers, start=1):
        planes = width * 2 ** (stage - 1)
        out_ch = planes * EXPANSION
        for index in range(blocks):
            torch_block, flax_block = f"layer{stage}.{index}", f"layer{stage}_{index}"
            convs = ((planes, in_ch, 1), (planes, planes, 3), (out_ch, planes, 1))
            for number, (conv_out, conv_in, k) in enumerate(convs, start=1):
                entries += _conv_entries(
                    f"{torch_block}.conv{number}",
                    (flax_block, f"conv{number}"),
                    conv_out,
                    conv_in,
                    k,
                )
                entries += _bn_entries(
                    f"{torch_block}.bn{number}", (flax_block, f"bn{number}"), conv_out
                )
            if (stage > 1 and index == 0) or in_ch != out_ch:
                entries += _conv_entries(
                    f"{torch_block}.downsample.0", (flax_block, "downsample_conv"), out_ch, in_ch, 1
                )
                entries += _bn_entries(
                    f"{torch_block}.downsample.1", (flax_block, "downsample_bn"), out_ch
                )
            in_ch = out_ch
    embed = width * 32
    entries.append(
        LayoutEntry(
            POSITIONAL_KEY,
            ((image_size // 32) ** 2 + 1, embed),
            "params",
            ("attnpool", "positional_embedding"),
            "vector",
        )
    )
    for name, out in (
        ("k_proj", embed),
        ("q_proj", embed),
        ("v_proj", embed),
        ("c_proj", output_dim),
    ):
        path = ("attnpool", name)
        entries += [
            LayoutEntry(
                f"attnpool.{name}.weight", (out, embed), "params", path + ("kernel",), "linear"
            ),
            LayoutEntry(f"attnpool.{name}.bias", (out,), "params", path + ("bias",), "vector"),
        ]
    return entries


def image_tower(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The image tower's entries of ``state_dict``: ``module.`` stripped, and, when any
    key is under ``visual.`` (a full CLIP model), only those keys, with the prefix
    stripped (the text tower's keys and ``logit_scale`` are ignored)."""
    stripped = {}
    for key, value in state_dict.items():
        for prefix in STRIPPED_PREFIXES:
            key = key.removeprefix(prefix)
        stripped[key] = value
    if any(key.startswith(VISUAL_PREFIX) for key in stripped):
        return {
            key[len(VISUAL_PREFIX) :]: value
            for key, value in stripped.items()
            if key.startswith(VISUAL_PREFIX)
        }
    return stripped


def detect_clip_resnet(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` (an image tower's or a full CLIP model's) has CLIP ResNet
    keys: the three-convolution stem, bottleneck blocks and the attention pool."""
    keys = image_tower(state_dict)
    return all(
        key in keys
        for key in (
            "conv3.weight",
            "layer1.0.conv3.weight",
            POSITIONAL_KEY,
            "attnpool.c_proj.weight",
        )
    )


def _check_grid(tower: Mapping[str, Any], image_size: int) -> None:
    """Refuse a positional embedding whose grid is not ``image_size``'s, saying which
    image size it was made for."""
    if POSITIONAL_KEY not in tower or np.ndim(tower[POSITIONAL_KEY]) != 2:
        return  # convert_layout names it as missing or mis-shaped
    rows = int(np.shape(tower[POSITIONAL_KEY])[0])
    grid = image_size // 32
    if rows == grid**2 + 1:
        return
    side = math.isqrt(max(rows - 1, 0))
    made_for = (
        f"a {side}x{side} grid + 1, images of {32 * side}x{32 * side}"
        if side * side == rows - 1
        else "no square grid + 1"
    )
    raise ValueError(
        f"{POSITIONAL_KEY} has {rows} rows ({made_for}); image_size={image_size} needs "
        f"{grid**2 + 1} rows (a {grid}x{grid} grid + 1): build and convert with the "
        f"checkpoint's image size"
    )


def convert_clip_resnet(
    state_dict: Mapping[str, Any],
    image_size: int = 224,
    *,
    layers: Sequence[int] = LAYERS,
    width: int = WIDTH,
    output_dim: int = FEATURE_DIM,
) -> dict[str, dict]:
    """Map a CLIP ResNet image-tower (or full CLIP model) state dict onto
    ``{'params': ..., 'batch_stats': ...}`` for ``CLIPResNet(image_size=image_size, ...)``.

    Strict (module docstring); RN50's architecture unless ``layers``/``width``/
    ``output_dim`` say otherwise. Errors name the keys and the expected shapes.
    """
    tower = image_tower(state_dict)
    _check_grid(tower, image_size)
    layout = clip_resnet_layout(image_size, layers, width, output_dim)
    description = (
        f"CLIP ResNet image tower (layers {tuple(layers)}, width {width}, image_size {image_size})"
    )
    return convert_layout(tower, layout, description)
