"""Seeded, torchvision-shaped ResNet weights and inputs for the parity tests.

This module owns the one definition of the random weights and images that both
``experiments/make_resnet_golden.py`` (run with torch and torchvision, writes
torchvision's logits) and ``tests/models/test_resnet_parity.py`` (no torch,
recomputes them with our ResNet) use, so the two cannot drift apart.

Weights are drawn from ``numpy.random.default_rng(seed)`` in torchvision's key
order, with ranges that keep activations O(1) through 50 layers with BatchNorm
in eval mode, yet exercise every term of the computation:

* conv weights ~ N(0, 2 / fan_in) (He scale);
* BatchNorm: scale ~ U(0.5, 1.5), except the last BN of each residual branch,
  U(0.1, 0.4), so that the residual sum does not grow by a factor per block;
  bias ~ N(0, 0.1^2); running mean ~ N(0, 0.1^2); running variance ~ U(0.5, 2)
  (positive, not all 1);
* fc weight ~ N(0, 1 / fan_in), fc bias ~ N(0, 0.1^2).

Every array is float32. ``weights_fingerprint`` hashes the drawn arrays, so a
change of NumPy's generator would show up as a clear test failure rather than as
a parity error.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sagm_jax.models.torchvision_weights import torchvision_layout

# The golden file's configuration, read by both the script and the test.
GOLDEN_ARCHS = ("resnet18", "resnet50")
GOLDEN_WEIGHT_SEEDS = {"resnet18": 18, "resnet50": 50}
GOLDEN_IMAGE_SEED = 2023  # the images of size s use seed GOLDEN_IMAGE_SEED + s
GOLDEN_SIZES = (64, 100)  # 100 is not a multiple of 32: odd feature maps meet stride-2 padding
GOLDEN_BATCH = 2


def _is_last_bn_of_branch(torch_key: str, arch: str) -> bool:
    last_bn = "bn3" if arch == "resnet50" else "bn2"
    return torch_key.startswith("layer") and f".{last_bn}." in torch_key


def draw_torchvision_weights(
    arch: str, seed: int, num_classes: int = 1000
) -> dict[str, np.ndarray]:
    """A torchvision ``state_dict()`` for ``arch`` (without counters), in its key order."""
    rng = np.random.default_rng(seed)
    weights = {}
    for entry in torchvision_layout(arch, num_classes):
        key, shape = entry.torch_key, entry.shape
        if entry.kind == "conv":
            fan_in = shape[1] * shape[2] * shape[3]
            array = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
        elif entry.kind == "linear":
            array = rng.standard_normal(shape) * np.sqrt(1.0 / shape[1])
        elif key.endswith(".weight"):  # BatchNorm scale
            low, high = (0.1, 0.4) if _is_last_bn_of_branch(key, arch) else (0.5, 1.5)
            array = rng.uniform(low, high, shape)
        elif key.endswith(".running_var"):
            array = rng.uniform(0.5, 2.0, shape)
        else:  # BatchNorm bias, running mean, fc bias
            array = rng.standard_normal(shape) * 0.1
        weights[key] = array.astype(np.float32)
    return weights


def draw_images(seed: int, batch: int, size: int) -> np.ndarray:
    """Normalized-looking images, N(0, 1), NCHW float32 (torch's layout; transpose for ours)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 3, size, size)).astype(np.float32)


def weights_fingerprint(weights: dict[str, np.ndarray]) -> str:
    """SHA-256 over the keys and float32 bytes, in order."""
    digest = hashlib.sha256()
    for key, array in weights.items():
        digest.update(key.encode())
        digest.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return digest.hexdigest()


# --- CLIP ResNet-50 image tower (sagm_jax.models.clip_resnet) ---------------------------
# The golden file's configuration (experiments/make_clip_resnet_golden.py and
# tests/models/test_clip_resnet.py): RN50 at 224x224, and a reduced variant at 64x64
# (one block per stage, width 8, 4 heads, a 2x2 grid) for the train-mode BatchNorm checks.
CLIP_RESNET_WEIGHT_SEED = 1050
CLIP_RESNET_IMAGE_SEED = 2224
CLIP_RESNET_SIZE = 224
CLIP_RESNET_SMALL = {"layers": (1, 1, 1, 1), "width": 8, "heads": 4, "output_dim": 32}
CLIP_RESNET_SMALL_SIZE = 64
CLIP_RESNET_SMALL_SEED = 1064
# Not a multiple of 32: maps of odd size (25 -> 12) meet the floor of the average pools.
CLIP_RESNET_ODD_SIZE = 100


def draw_clip_resnet_weights(
    seed: int,
    image_size: int = 224,
    layers: tuple[int, ...] = (3, 4, 6, 3),
    width: int = 64,
    output_dim: int = 1024,
) -> dict[str, np.ndarray]:
    """An open_clip ``ModifiedResNet.state_dict()`` (without counters), in its key order.

    As ``draw_torchvision_weights``: convs N(0, 2 / fan_in); BatchNorm scale U(0.5, 1.5),
    except each block's ``bn3`` U(0.1, 0.4); BatchNorm bias and running mean N(0, 0.1^2),
    running variance U(0.5, 2). The attention pool's projections N(0, 1 / fan_in), their
    biases N(0, 0.1^2), the positional embedding N(0, 0.5^2) (comparable to the tokens).
    """
    from sagm_jax.models.clip_resnet_weights import clip_resnet_layout

    rng = np.random.default_rng(seed)
    weights = {}
    for entry in clip_resnet_layout(image_size, layers, width, output_dim):
        key, shape = entry.torch_key, entry.shape
        if entry.kind == "conv":
            array = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
        elif entry.kind == "linear":
            array = rng.standard_normal(shape) * np.sqrt(1.0 / shape[1])
        elif key.endswith("positional_embedding"):
            array = rng.standard_normal(shape) * 0.5
        elif key.endswith(".weight"):  # BatchNorm scale
            last = key.startswith("layer") and ".bn3." in key
            array = rng.uniform(*((0.1, 0.4) if last else (0.5, 1.5)), shape)
        elif key.endswith(".running_var"):
            array = rng.uniform(0.5, 2.0, shape)
        else:  # BatchNorm bias, running mean, linear biases
            array = rng.standard_normal(shape) * 0.1
        weights[key] = array.astype(np.float32)
    return weights


# --- RegNetY-16GF (sagm_jax.models.regnet) --------------------------------------------
# The golden file's configuration (experiments/make_regnet_golden.py and
# tests/models/test_regnet.py): RegNetY-16GF at 224x224, batch 2; a reduced RegNetY
# (stem 8, stages of depth 1, 2, 1, 1, widths 16 .. 64, group widths 8 and 16) at
# 36x36 (maps 18, 9, 5, 3, 2: odd sizes meet the stride-2 padding) in eval and in
# train mode (batch statistics).
REGNET_GOLDEN_WEIGHT_SEED = 1616
REGNET_GOLDEN_IMAGE_SEED = 224
REGNET_GOLDEN_SIZE = 224
REGNET_GOLDEN_BATCH = 2
REGNET_SMALL_WEIGHT_SEED = 36
REGNET_SMALL_IMAGE_SEED = 37
REGNET_SMALL_SIZE = 36
REGNET_SMALL_STEM = 8
REGNET_SMALL_CLASSES = 5
# (depths, widths, group widths, bottleneck multipliers), as regnet.BlockParams
REGNET_SMALL_PARAMS = ((1, 2, 1, 1), (16, 24, 48, 64), (8, 8, 16, 16), (1.0, 1.0, 1.0, 1.0))


def draw_regnet_weights(
    seed: int, num_classes: int = 1000, params=None, stem_width: int | None = None
) -> dict[str, np.ndarray]:
    """A torchvision ``RegNet.state_dict()`` (without counters), in its key order:
    RegNetY-16GF's unless ``params`` (a ``regnet.BlockParams`` or its 4-tuple) and
    ``stem_width`` are given.

    Conv weights (the grouped 3x3 and the SE layers' 1x1 convs included) ~ N(0, 2 /
    fan_in) with fan_in = in / groups * kh * kw; BatchNorm scale ~ U(0.5, 1.5), except
    the branch's last BN (``f.c.1``), U(0.1, 0.4), so the residual sums stay O(1);
    BN bias, running mean and the SE and classifier biases ~ N(0, 0.1^2); running
    variance ~ U(0.5, 2); classifier weight ~ N(0, 1 / fan_in). float32.
    """
    from sagm_jax.models.regnet import REGNET_Y_16GF, STEM_WIDTH, BlockParams
    from sagm_jax.models.regnet_weights import regnet_layout

    params = REGNET_Y_16GF if params is None else BlockParams(*params)
    layout = regnet_layout(num_classes, params, stem_width=stem_width or STEM_WIDTH)
    rng = np.random.default_rng(seed)
    weights = {}
    for entry in layout:
        key, shape = entry.torch_key, entry.shape
        if entry.kind == "conv":
            array = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
        elif entry.kind == "linear":
            array = rng.standard_normal(shape) * np.sqrt(1.0 / shape[1])
        elif key.endswith(".weight"):  # BatchNorm scale
            low, high = (0.1, 0.4) if ".f.c.1." in key else (0.5, 1.5)
            array = rng.uniform(low, high, shape)
        elif key.endswith(".running_var"):
            array = rng.uniform(0.5, 2.0, shape)
        else:  # BatchNorm bias, running mean, SE and classifier biases
            array = rng.standard_normal(shape) * 0.1
        weights[key] = array.astype(np.float32)
    return weights


# --- CLIP ViT-B/16 and DINOv2 ViT-B/14 (sagm_jax.models.vit) ----------------------------
# The golden file's configuration (experiments/make_vit_golden.py and
# tests/models/test_vit.py): each network at 224x224, batch 2; DINOv2's position-table
# resampling on a small seeded table (the checkpoint's 37x37 grid, 3 channels) to the
# grids VIT_POS_GRIDS (16: 224-pixel images; 8, 23: other downsamplings; 40: upsampling).
VIT_WEIGHT_SEEDS = {"clip_vit_b16": 1616, "dinov2_vit_b14": 1414}
VIT_IMAGE_SEED = 2242
VIT_SIZE = 224
VIT_BATCH = 2
VIT_POS_SEED = 3737
VIT_POS_WIDTH = 3
VIT_POS_GRIDS = (16, 8, 23, 40)


def _draw_vit(layout, seed: int) -> dict[str, np.ndarray]:
    """Arrays for a ViT ``layout``, in its order: patch convs and linear layers
    N(0, 2 / fan_in) (He); CLIP's ``proj`` N(0, 1 / width); LayerNorm scale U(0.5, 1.5),
    every bias N(0, 0.1^2); class token, mask token and position table N(0, 0.5^2)
    (comparable to the patch embeddings); DINOv2's LayerScale U(0.1, 0.5), so that the
    residual stream grows slowly over the blocks. Attention logits then have a standard
    deviation near 2: the softmax is neither uniform nor one-hot."""
    rng = np.random.default_rng(seed)
    weights = {}
    for entry in layout:
        key, shape = entry.torch_key, entry.shape
        if entry.kind in ("conv", "linear") or key.endswith("in_proj_weight"):
            array = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
        elif key == "proj":
            array = rng.standard_normal(shape) * np.sqrt(1.0 / shape[0])
        elif key.endswith(".gamma"):
            array = rng.uniform(0.1, 0.5, shape)
        elif key.endswith(".weight"):  # LayerNorm scale
            array = rng.uniform(0.5, 1.5, shape)
        elif key.endswith("bias"):
            array = rng.standard_normal(shape) * 0.1
        else:  # class/mask token, position table
            array = rng.standard_normal(shape) * 0.5
        weights[key] = array.astype(np.float32)
    return weights


def draw_clip_vit_weights(seed: int, image_size: int = 224, **architecture) -> dict[str, np.ndarray]:
    """An open_clip ``VisionTransformer.state_dict()`` (ViT-B/16 unless ``architecture``
    gives ``vit_weights.clip_vit_layout``'s patch_size, width, depth, output_dim)."""
    from sagm_jax.models.vit_weights import clip_vit_layout

    return _draw_vit(clip_vit_layout(image_size, **architecture), seed)


def draw_dinov2_weights(seed: int, **architecture) -> dict[str, np.ndarray]:
    """A DINOv2 hub checkpoint's state dict (ViT-B/14 with the 37x37 position grid unless
    ``architecture`` gives ``vit_weights.dinov2_layout``'s keywords)."""
    from sagm_jax.models.vit_weights import dinov2_layout

    return _draw_vit(dinov2_layout(**architecture), seed)


def draw_pos_table(seed: int, grid: int, width: int) -> np.ndarray:
    """A DINOv2-shaped position table [1, 1 + grid^2, width], N(0, 1)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, 1 + grid * grid, width)).astype(np.float32)
