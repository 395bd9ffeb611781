"""CLIP ViT-B/16 and DINOv2 ViT-B/14 checkpoints: layouts, conversion, detection, and
DINOv2's position-table resampling. NumPy only.

Layouts (``LayoutEntry`` tables, the reference ``state_dict()`` keys in its order):

* ``clip_vit_layout``: open_clip's ``model.visual.state_dict()`` (OpenAI's
  ``clip/model.py`` ``VisionTransformer`` has the same keys): ``class_embedding`` [D],
  ``positional_embedding`` [grid^2 + 1, D], ``proj`` [D, 512] (used as ``x @ proj``, so
  kept as it is), ``conv1.weight`` (no bias), ``ln_pre``, ``transformer.resblocks.N``
  (``ln_1``, ``attn.in_proj_weight``/``in_proj_bias``, ``attn.out_proj``, ``ln_2``,
  ``mlp.c_fc``, ``mlp.c_proj``), ``ln_post``. Ours: ``ln_1``/``ln_2`` -> ``norm1``/
  ``norm2``, ``attn.in_proj_*`` -> ``attn/qkv``, ``attn.out_proj`` -> ``attn/proj``,
  ``mlp.c_fc``/``c_proj`` -> ``mlp/fc1``/``fc2``, ``positional_embedding`` ->
  ``pos_embedding``; the rest keep their names.
* ``dinov2_layout``: the hub's ``dinov2_vitb14_pretrain.pth``: ``cls_token`` [1, 1, D],
  ``pos_embed`` [1, 37^2 + 1, D], ``mask_token`` [1, D], ``patch_embed.proj``,
  ``blocks.N`` (``norm1``, ``attn.qkv``, ``attn.proj``, ``ls1.gamma``, ``norm2``,
  ``mlp.fc1``, ``mlp.fc2``, ``ls2.gamma``), ``norm``. Ours: ``cls_token`` ->
  ``class_embedding`` [D], ``pos_embed`` -> ``pos_embedding`` [grid^2 + 1, D] at the
  model's grid, ``patch_embed.proj`` -> ``conv1``; blocks keep their names.

Conversion (``convert_clip_vit``, ``convert_dinov2``) is strict (``convert_layout``:
missing, unexpected and mis-shaped keys are errors naming them), strips a ``module.``
prefix, and reads float16 arrays (OpenAI's CLIP checkpoints) as float32. The
architecture (width, depth, patch size, output width) is read from the arrays' shapes,
so a smaller network of the same family converts too. ``convert_clip_vit`` also takes a
whole CLIP model's state dict: when keys start with ``visual.`` only those are read (the
image tower) and the text tower's keys (``token_embedding``, ``transformer.*``,
``text_projection``, ``logit_scale``, ...) are ignored. ``convert_dinov2`` ignores
``mask_token`` (used only by DINOv2's masked-image training, never at inference) and
resamples ``pos_embed`` to the model's grid once (``resample_dinov2_pos_embed``).

DINOv2's resampling. For input images of g x g patches, DINOv2
(``DinoVisionTransformer.interpolate_pos_encoding``, hub settings
``interpolate_offset`` 0.1, ``interpolate_antialias`` False) resamples the M x M
(M = 37) patch rows of the table by torch's ``F.interpolate(mode="bicubic",
scale_factor=(g + 0.1) / M, align_corners=False)`` and keeps the class row; when
g = M it uses the table unchanged. Given a scale factor s, torch's output size is
floor(M s) = g and output index i samples the source coordinate
x = (i + 0.5) / s - 0.5 (with 1 / s rounded to float32, as torch's float kernel), i.e. the
scale, not M / g (which ``transformers``' DINOv2 port uses: a different table). With
x0 = floor(x) (at most M - 1), t = x - x0 clipped to [0, 1], the value is
sum_j w_j(t) v[clip(x0 - 1 + j, 0, M - 1)], j = 0..3, Keys' cubic kernel with
A = -0.75: w = (k2(t + 1), k1(t), k1(1 - t), k2(2 - t)),
k1(d) = ((A + 2) d - (A + 3)) d^2 + 1, k2(d) = ((A d - 5A) d + 8A) d - 4A; the two axes
separably (a weight matrix per axis).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from sagm_jax.models.torchvision_weights import LayoutEntry, convert_layout
from sagm_jax.models.vit import CLIP_PATCH, DINOV2_CHECKPOINT_GRID, DINOV2_PATCH

CUBIC_A = -0.75
DINOV2_INTERPOLATE_OFFSET = 0.1
CLIP_PREFIX = "visual."
IGNORED_DINOV2_KEYS = ("mask_token",)


def _linear(key, shape, path):
    return [LayoutEntry(f"{key}.weight", shape, "params", path + ("kernel",), "linear"),
            LayoutEntry(f"{key}.bias", shape[:1], "params", path + ("bias",), "vector")]


def _norm(key, width, path):
    return [LayoutEntry(f"{key}.weight", (width,), "params", path + ("scale",), "vector"),
            LayoutEntry(f"{key}.bias", (width,), "params", path + ("bias",), "vector")]


def clip_vit_layout(
    image_size: int = 224,
    *,
    patch_size: int = CLIP_PATCH,
    width: int = 768,
    depth: int = 12,
    output_dim: int = 512,
    input_channels: int = 3,
) -> list[LayoutEntry]:
    """open_clip's ``VisionTransformer.state_dict()`` keys for this architecture."""
    rows = (image_size // patch_size) ** 2 + 1
    entries = [
        LayoutEntry("class_embedding", (width,), "params", ("class_embedding",), "vector"),
        LayoutEntry("positional_embedding", (rows, width), "params", ("pos_embedding",), "vector"),
        LayoutEntry("proj", (width, output_dim), "params", ("proj",), "vector"),
        LayoutEntry("conv1.weight", (width, input_channels, patch_size, patch_size), "params",
                    ("conv1", "kernel"), "conv"),
        *_norm("ln_pre", width, ("ln_pre",)),
    ]
    for index in range(depth):
        key, path = f"transformer.resblocks.{index}", (f"blocks_{index}",)
        entries += _norm(f"{key}.ln_1", width, path + ("norm1",))
        entries += [
            LayoutEntry(f"{key}.attn.in_proj_weight", (3 * width, width), "params",
                        path + ("attn", "qkv", "kernel"), "linear"),
            LayoutEntry(f"{key}.attn.in_proj_bias", (3 * width,), "params",
                        path + ("attn", "qkv", "bias"), "vector"),
        ]
        entries += _linear(f"{key}.attn.out_proj", (width, width), path + ("attn", "proj"))
        entries += _norm(f"{key}.ln_2", width, path + ("norm2",))
        entries += _linear(f"{key}.mlp.c_fc", (4 * width, width), path + ("mlp", "fc1"))
        entries += _linear(f"{key}.mlp.c_proj", (width, 4 * width), path + ("mlp", "fc2"))
    return entries + _norm("ln_post", width, ("ln_post",))


def dinov2_layout(
    *,
    patch_size: int = DINOV2_PATCH,
    width: int = 768,
    depth: int = 12,
    checkpoint_grid: int = DINOV2_CHECKPOINT_GRID,
) -> list[LayoutEntry]:
    """The hub checkpoint's keys (``DinoVisionTransformer.state_dict()``, no registers,
    unchunked blocks). ``pos_embed`` lands in ``pos_embedding`` at the checkpoint's grid and
    ``mask_token`` in ``mask_token``: :func:`convert_dinov2` resamples the one and drops
    the other."""
    rows = checkpoint_grid**2 + 1
    entries = [
        LayoutEntry("cls_token", (1, 1, width), "params", ("class_embedding",), "vector"),
        LayoutEntry("pos_embed", (1, rows, width), "params", ("pos_embedding",), "vector"),
        LayoutEntry("mask_token", (1, width), "params", ("mask_token",), "vector"),
        LayoutEntry("patch_embed.proj.weight", (width, 3, patch_size, patch_size), "params",
                    ("conv1", "kernel"), "conv"),
        LayoutEntry("patch_embed.proj.bias", (width,), "params", ("conv1", "bias"), "vector"),
    ]
    for index in range(depth):
        key, path = f"blocks.{index}", (f"blocks_{index}",)
        entries += _norm(f"{key}.norm1", width, path + ("norm1",))
        entries += _linear(f"{key}.attn.qkv", (3 * width, width), path + ("attn", "qkv"))
        entries += _linear(f"{key}.attn.proj", (width, width), path + ("attn", "proj"))
        entries.append(LayoutEntry(f"{key}.ls1.gamma", (width,), "params",
                                   path + ("ls1", "gamma"), "vector"))
        entries += _norm(f"{key}.norm2", width, path + ("norm2",))
        entries += _linear(f"{key}.mlp.fc1", (4 * width, width), path + ("mlp", "fc1"))
        entries += _linear(f"{key}.mlp.fc2", (width, 4 * width), path + ("mlp", "fc2"))
        entries.append(LayoutEntry(f"{key}.ls2.gamma", (width,), "params",
                                   path + ("ls2", "gamma"), "vector"))
    return entries + _norm("norm", width, ("norm",))


def _strip(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {key.removeprefix(prefix): value for key, value in state_dict.items()}


def clip_image_tower(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The image tower's keys of a CLIP state dict: without ``module.``, and when any key
    starts with ``visual.`` (a whole CLIP model), only those keys, without the prefix."""
    state_dict = _strip(state_dict, "module.")
    if any(key.startswith(CLIP_PREFIX) for key in state_dict):
        return {key[len(CLIP_PREFIX):]: value for key, value in state_dict.items()
                if key.startswith(CLIP_PREFIX)}
    return dict(state_dict)


def _depth(state_dict, pattern: str, default: int) -> int:
    indices = {int(m.group(1)) for key in state_dict if (m := re.match(pattern, key))}
    return max(indices) + 1 if indices else default


def _shape(state_dict, key, ndim):
    shape = tuple(np.shape(state_dict[key])) if key in state_dict else ()
    return shape if len(shape) == ndim else None


def convert_clip_vit(state_dict: Mapping[str, Any], image_size: int = 224) -> dict[str, dict]:
    """A CLIP ViT image tower's state dict (open_clip ``model.visual``, or a whole CLIP
    model's with ``visual.`` keys: the text tower's keys are then ignored) as
    ``{'params': ..., 'batch_stats': {}}`` for ``ClipViT`` at ``image_size``.

    The checkpoint's ``positional_embedding`` fixes the image size (197 rows: 224); a
    model of another size is refused (open_clip does not resample the table)."""
    tower = clip_image_tower(state_dict)
    conv = _shape(tower, "conv1.weight", 4) or (768, 3, CLIP_PATCH, CLIP_PATCH)
    width, channels, patch = conv[0], conv[1], conv[2]
    proj = _shape(tower, "proj", 2)
    output_dim = proj[1] if proj else 512
    depth = _depth(tower, r"transformer\.resblocks\.(\d+)\.", 12)
    pos = _shape(tower, "positional_embedding", 2)
    grid = image_size // patch
    if pos and pos[0] != grid * grid + 1 and math.isqrt(pos[0] - 1) ** 2 == pos[0] - 1:
        source = math.isqrt(pos[0] - 1)
        raise ValueError(
            f"CLIP positional_embedding has {pos[0]} rows, a {source}x{source} grid of "
            f"{patch}-pixel patches (image size {source * patch}); the model is built for "
            f"image_size {image_size} ({grid}x{grid}, {grid * grid + 1} rows). CLIP does not "
            f"resample its position table: build the model at image_size {source * patch}"
        )
    layout = clip_vit_layout(image_size, patch_size=patch, width=width, depth=depth,
                             output_dim=output_dim, input_channels=channels)
    return convert_layout(tower, layout, f"CLIP ViT ({depth} blocks, width {width})")


def cubic_weights(in_size: int, out_size: int, scale: float) -> np.ndarray:
    """[out_size, in_size]: torch's bicubic (align_corners=False, no antialias) along one
    axis given the scale factor ``scale`` (module docstring)."""
    # torch: a float32 ratio times the double (i + 0.5), rounded to float32 once.
    ratio = np.float64(np.float32(1.0 / scale))
    source = (ratio * (np.arange(out_size) + 0.5) - 0.5).astype(np.float32)
    start = np.minimum(np.floor(source).astype(np.int64), in_size - 1)
    t = np.clip(source.astype(np.float64) - start, 0.0, 1.0)

    def near(d):  # |d| <= 1
        return ((CUBIC_A + 2) * d - (CUBIC_A + 3)) * d * d + 1

    def far(d):  # 1 < |d| < 2
        return ((CUBIC_A * d - 5 * CUBIC_A) * d + 8 * CUBIC_A) * d - 4 * CUBIC_A

    coefficients = (far(t + 1), near(t), near(1 - t), far(2 - t))
    weights = np.zeros((out_size, in_size))
    rows = np.arange(out_size)
    for j, coefficient in enumerate(coefficients):
        np.add.at(weights, (rows, np.clip(start - 1 + j, 0, in_size - 1)), coefficient)
    return weights


def resample_dinov2_pos_embed(pos_embed: np.ndarray, grid: int) -> np.ndarray:
    """DINOv2's position table [1, 1 + M^2, D] for inputs of ``grid`` x ``grid`` patches:
    [1, 1 + grid^2, D], resampled as ``interpolate_pos_encoding`` does (module docstring;
    unchanged when grid = M)."""
    pos_embed = np.asarray(pos_embed, dtype=np.float32)
    source = math.isqrt(pos_embed.shape[1] - 1)
    if source * source != pos_embed.shape[1] - 1:
        raise ValueError(
            f"pos_embed of shape {pos_embed.shape}: its patch rows are not a square grid"
        )
    if grid == source:
        return pos_embed
    scale = float(grid + DINOV2_INTERPOLATE_OFFSET) / source
    if math.floor(float(source * scale)) != grid:  # torch's output size for this scale
        raise ValueError(f"scale factor {scale} does not give a {grid}-patch grid")
    weights = cubic_weights(source, grid, scale)
    table = pos_embed[0, 1:].reshape(source, source, -1).astype(np.float64)
    table = np.einsum("ia,jb,abd->ijd", weights, weights, table)
    patches = table.reshape(1, grid * grid, -1).astype(np.float32)
    return np.concatenate([pos_embed[:, :1], patches], axis=1)


def convert_dinov2(state_dict: Mapping[str, Any], image_size: int = 224) -> dict[str, dict]:
    """The hub's DINOv2 ViT state dict (``dinov2_vitb14_pretrain.pth`` layout) as
    ``{'params': ..., 'batch_stats': {}}`` for ``DinoV2ViT`` at ``image_size``: the
    position table resampled to image_size // patch patches a side, ``mask_token``
    ignored whether present or not (training-only)."""
    state_dict = _strip(state_dict, "module.")
    conv = _shape(state_dict, "patch_embed.proj.weight", 4) or (768, 3, DINOV2_PATCH, DINOV2_PATCH)
    width, patch = conv[0], conv[2]
    depth = _depth(state_dict, r"blocks\.(\d+)\.", 12)
    pos = _shape(state_dict, "pos_embed", 3)
    checkpoint_grid = DINOV2_CHECKPOINT_GRID
    if pos and math.isqrt(pos[1] - 1) ** 2 == pos[1] - 1:
        checkpoint_grid = math.isqrt(pos[1] - 1)
    layout = [entry for entry in dinov2_layout(patch_size=patch, width=width, depth=depth,
                                               checkpoint_grid=checkpoint_grid)
              if entry.torch_key not in IGNORED_DINOV2_KEYS]
    used = {key: value for key, value in state_dict.items() if key not in IGNORED_DINOV2_KEYS}
    variables = convert_layout(used, layout, f"DINOv2 ViT ({depth} blocks, width {width})")
    params = variables["params"]
    params["class_embedding"] = params["class_embedding"].reshape(width)
    params["pos_embedding"] = resample_dinov2_pos_embed(
        params["pos_embedding"], image_size // patch
    )[0]
    return variables


def detect_clip_vit(state_dict: Mapping[str, Any]) -> bool:
    """Whether the keys are a CLIP ViT image tower's (or a whole CLIP ViT model's)."""
    tower = clip_image_tower(state_dict)
    return all(key in tower for key in ("class_embedding", "positional_embedding", "conv1.weight",
                                        "transformer.resblocks.0.attn.in_proj_weight"))


def detect_dinov2(state_dict: Mapping[str, Any]) -> bool:
    """Whether the keys are a DINOv2 ViT's (the hub checkpoint's layout)."""
    keys = _strip(state_dict, "module.")
    return all(key in keys for key in ("cls_token", "pos_embed", "patch_embed.proj.weight",
                                       "blocks.0.attn.qkv.weight", "blocks.0.ls1.gamma"))
