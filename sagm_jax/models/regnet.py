"""Flax RegNetY-16GF that computes what torchvision's ``regnet_y_16gf`` computes.

This module owns the RegNetY architecture (the network of SWAG's RegNetY-16GF
weights, MIRO's ``swag_regnety_16gf`` backbone) in the DomainBed configuration:
the ImageNet classifier removed, dropout on the pooled 3024-d feature, a fresh
linear classifier ``classifier`` (``resnet.linear_head``). The weights' key layouts
and their conversion are in ``regnet_weights``.

Stage parameters. torchvision's ``BlockParams.from_init_params`` (RegNet's
quantised linear widths, Radosavovic et al. 2020), recomputed here in NumPy in
torch's float32 (:func:`regnet_block_params`): for block ``j < depth``,
``u_j = w_0 + w_a * j``, ``s_j = round(log(u_j / w_0) / log(w_m))``,
``w_j = 8 * round(w_0 * w_m ** s_j / 8)``; consecutive blocks of equal width form a
stage (its width and depth); each stage's bottleneck width ``int(w * b)`` is then
made divisible by its group width ``g = min(group_width, int(w * b))``
(torchvision's ``_make_divisible``) and the stage width recomputed from it.
RegNetY-16GF (depth 18, w_0 200, w_a 106.23, w_m 2.48, group width 112): stage
widths 224, 448, 1232, 3024, depths 2, 4, 11, 1.

The network (torchvision's ``RegNet`` with ``SimpleStemIN`` and
``ResBottleneckBlock``, BatchNorm eps 1e-5):

* stem: 3x3 conv stride 2 -> ``stem_width`` (32), BN, ReLU;
* stage i (``block1`` .. ``block4``), block j (``block{i}_{j}``, torchvision's
  ``block{i}-{j}``), input width ``w_in``, output width ``w``, stride 2 on the first
  block of each stage, bottleneck width ``w_b = round(w * b)`` (b = 1):

    a = ReLU(BN(conv1x1(x)))                        [w_b]
    h = ReLU(BN(groupconv3x3_stride(a), w_b / g groups))
    s = sigmoid(W2 ReLU(W1 mean_hw(h) + b1) + b2)    squeeze width round(se_ratio * w_in)
    f = BN(conv1x1(h * s))                           [w]
    y = ReLU(f + x)   or   ReLU(f + BN(conv1x1_stride(x)))  when w_in != w or stride != 1

  (``se_ratio`` 0.25: the squeeze width comes from the block's INPUT width, as
  torchvision's ``BottleneckTransform`` computes it);
* global average pool -> the 3024-d feature (MIRO's SWAG featurizer:
  ``khanrc/miro``, ``domainbed/networks/backbones.py``, replaces the head by
  ``AdaptiveAvgPool2d(1)`` + ``Flatten``) -> dropout -> ``classifier``.

Padding. torchvision pads every 3x3 conv symmetrically by 1 (also at stride 2);
Flax's 'SAME' is asymmetric at stride 2, so every padding here is explicit. The
non-grouped convolutions are ``resnet.Conv`` (a dot of patches on the CPU); the
grouped 3x3 is ``jax.lax.conv_general_dilated`` with ``feature_group_count``.

BatchNorm. As ``resnet``: ``y = (x - mean) / sqrt(var + 1e-5) * scale + bias``;
frozen (``freeze_batchnorm=True``, the default and MIRO's setting): the running
statistics in training and evaluation alike, never updated; trainable: batch
statistics in training and torch's momentum-0.1 running updates
(``mutable=['batch_stats']``).

Variable names: the stem's conv and BN are ``conv1``/``bn1`` (the names ResNet's
stem has, so ``torchvision_weights.with_pretrained_backbone`` fits a pretrained stem
to other than 3 input channels the same way); block ``block{i}_{j}`` holds
``a_conv``/``a_bn``, ``b_conv``/``b_bn``, ``se_fc1``/``se_fc2`` (1x1 conv kernels
[1, 1, in, out] and biases), ``c_conv``/``c_bn`` and, when it projects,
``proj_conv``/``proj_bn``.

Intermediate features (collection ``resnet.INTERMEDIATES``, NHWC): ``"stem"`` is the
stem's output, ``"block1"`` .. ``"block4"`` the outputs of torchvision's
``trunk_output.block1`` .. ``block4``, the modules MIRO hooks for RegNetY
(``khanrc/miro``, ``domainbed/networks/ur_networks.py``, ``BLOCKNAMES["regnety"]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

from sagm_jax.models.resnet import (
    INTERMEDIATES,
    batchnorm,
    check_images,
    conv,
    conv_init,
    linear_head,
)

# torchvision's SWAG weights (IMAGENET1K_SWAG_LINEAR_V1, the frozen SWAG trunk) are
# evaluated with ImageClassification's default ImageNet normalisation.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FEATURE_DIM = 3024
FEATURE_MAPS = True
SE_RATIO = 0.25
STEM_WIDTH = 32


class BlockParams(NamedTuple):
    """Per-stage parameters of a RegNet (torchvision's ``BlockParams``, stride 2 each)."""

    depths: tuple[int, ...]
    widths: tuple[int, ...]
    group_widths: tuple[int, ...]
    bottleneck_multipliers: tuple[float, ...]


def make_divisible(value: float, divisor: int) -> int:
    """torchvision's ``_make_divisible``: the nearest multiple of ``divisor`` (at least
    ``divisor``), one step up when rounding lost more than 10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def regnet_block_params(
    depth: int,
    w_0: int,
    w_a: float,
    w_m: float,
    group_width: int,
    bottleneck_multiplier: float = 1.0,
) -> BlockParams:
    """torchvision's ``BlockParams.from_init_params``, in float32 as torch computes it."""
    if w_a < 0 or w_0 <= 0 or w_m <= 1 or w_0 % 8 != 0:
        raise ValueError(f"invalid RegNet settings w_0={w_0}, w_a={w_a}, w_m={w_m}")
    f32 = np.float32
    widths_cont = np.arange(depth).astype(f32) * f32(w_a) + f32(w_0)
    capacity = np.round(np.log(widths_cont / f32(w_0)) / f32(math.log(w_m))).astype(f32)
    block_widths = (np.round(f32(w_0) * np.power(f32(w_m), capacity) / f32(8)) * 8).astype(int)
    block_widths = block_widths.tolist()
    starts = [j for j in range(depth) if j == 0 or block_widths[j] != block_widths[j - 1]]
    stage_widths = [block_widths[j] for j in starts]
    stage_depths = np.diff(starts + [depth]).tolist()
    multipliers = [bottleneck_multiplier] * len(stage_widths)
    bottlenecks = [int(w * b) for w, b in zip(stage_widths, multipliers)]
    group_widths = [min(group_width, w_b) for w_b in bottlenecks]
    bottlenecks = [make_divisible(w_b, g) for w_b, g in zip(bottlenecks, group_widths)]
    stage_widths = [int(w_b / b) for w_b, b in zip(bottlenecks, multipliers)]
    return BlockParams(
        tuple(stage_depths), tuple(stage_widths), tuple(group_widths), tuple(multipliers)
    )


# torchvision's regnet_y_16gf (SWAG's RegNetY16gf: the same parameters).
REGNET_Y_16GF = regnet_block_params(depth=18, w_0=200, w_a=106.23, w_m=2.48, group_width=112)


def squeeze_width(width_in: int, se_ratio: float) -> int:
    """The SE layer's squeeze width: ``round(se_ratio * width_in)`` of the block's input."""
    return round(se_ratio * width_in)


class GroupedConv(nn.Module):
    """A bias-free 3x3 convolution in ``groups`` groups, padded symmetrically by 1
    (torch's ``Conv2d(groups=g, padding=1)``); kernel [3, 3, in / groups, out]."""

    features: int
    stride: int
    groups: int

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", conv_init, (3, 3, x.shape[-1] // self.groups, self.features))
        x, w = promote_dtype(x, w, dtype=None)
        return jax.lax.conv_general_dilated(
            x,
            w,
            (self.stride, self.stride),
            ((1, 1), (1, 1)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=self.groups,
        )


class SqueezeExcitation(nn.Module):
    """torchvision's ``SqueezeExcitation``: ``x * sigmoid(fc2(relu(fc1(mean_hw(x)))))``,
    ``fc1`` and ``fc2`` 1x1 convolutions with bias (kernels [1, 1, in, out]; a fresh
    network's biases start at zero, its kernels as torchvision's RegNet init)."""

    squeeze: int

    @nn.compact
    def __call__(self, x):
        pooled = jnp.mean(x, axis=(1, 2), keepdims=True)
        hidden = nn.relu(self._fc(self.squeeze, "fc1")(pooled))
        return x * nn.sigmoid(self._fc(x.shape[-1], "fc2")(hidden))

    @staticmethod
    def _fc(features: int, name: str) -> nn.Conv:
        return nn.Conv(
            features,
            (1, 1),
            padding="VALID",
            kernel_init=conv_init,
            bias_init=nn.initializers.zeros,
            name=name,
        )


class ResBottleneckBlock(nn.Module):
    """torchvision's ``ResBottleneckBlock`` with its ``BottleneckTransform`` (SE
    included); see the module docstring for the computation."""

    width_in: int
    width: int
    stride: int
    group_width: int
    bottleneck_multiplier: float
    se_ratio: float
    use_running_average: bool

    @nn.compact
    def __call__(self, x):
        bn = lambda name: batchnorm(self.use_running_average, name)
        w_b = round(self.width * self.bottleneck_multiplier)
        y = nn.relu(bn("a_bn")(conv(w_b, 1, 1, "a_conv")(x)))
        y = GroupedConv(w_b, self.stride, w_b // self.group_width, name="b_conv")(y)
        y = nn.relu(bn("b_bn")(y))
        if self.se_ratio:
            squeeze = squeeze_width(self.width_in, self.se_ratio)
            y = SqueezeExcitation(squeeze, name="se")(y)
        y = bn("c_bn")(conv(self.width, 1, 1, "c_conv")(y))
        if self.width_in != self.width or self.stride != 1:
            x = bn("proj_bn")(conv(self.width, 1, self.stride, "proj_conv")(x))
        return nn.relu(x + y)


class RegNet(nn.Module):
    """torchvision's RegNetY with DomainBed's head: pooled feature -> dropout -> classifier.

    Attributes (the stage parameters default to RegNetY-16GF's, ``REGNET_Y_16GF``;
    smaller values make the reduced networks the tests use):
      num_classes: outputs of the fresh linear classifier.
      dropout_rate: dropout on the pooled feature in training (may be traced).
      freeze_batchnorm: use and keep the running statistics (see module docstring).
      input_channels: channels the images must have (3 for the pretrained weights).
      stem_width: the stem conv's output width.
      depths, widths, group_widths, bottleneck_multipliers: per stage, as
        torchvision's ``BlockParams``.
      se_ratio: the SE squeeze width per block input width (0 disables SE: RegNetX).
    """

    num_classes: int
    dropout_rate: float = 0.0
    freeze_batchnorm: bool = True
    input_channels: int = 3
    stem_width: int = STEM_WIDTH
    depths: Sequence[int] = REGNET_Y_16GF.depths
    widths: Sequence[int] = REGNET_Y_16GF.widths
    group_widths: Sequence[int] = REGNET_Y_16GF.group_widths
    bottleneck_multipliers: Sequence[float] = REGNET_Y_16GF.bottleneck_multipliers
    se_ratio: float = SE_RATIO

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mixstyle: bool = False, features=False):
        """Logits [B, num_classes] for normalised NHWC float images ``x`` (with
        ``features``: ``(features [B, widths[-1]], logits)``). ``mixstyle`` is accepted
        for the common interface and ignored (MixStyle is a ResNet layer)."""
        check_images(x, self.input_channels, "RegNet")
        use_running_average = self.freeze_batchnorm or not train
        x = conv(self.stem_width, 3, 2, "conv1")(x)
        x = nn.relu(batchnorm(use_running_average, "bn1")(x))
        self.sow(INTERMEDIATES, "stem", x)
        width_in = self.stem_width
        stages = zip(self.depths, self.widths, self.group_widths, self.bottleneck_multipliers)
        for stage, (depth, width, group_width, multiplier) in enumerate(stages, start=1):
            for index in range(depth):
                x = ResBottleneckBlock(
                    width_in=width_in if index == 0 else width,
                    width=width,
                    stride=2 if index == 0 else 1,
                    group_width=group_width,
                    bottleneck_multiplier=multiplier,
                    se_ratio=self.se_ratio,
                    use_running_average=use_running_average,
                    name=f"block{stage}_{index}",
                )(x)
            self.sow(INTERMEDIATES, f"block{stage}", x)
            width_in = width
        feature = jnp.mean(x, axis=(1, 2))
        return linear_head(feature, self.num_classes, self.dropout_rate, train, features=features)


def build(
    num_classes: int,
    *,
    dropout_rate=0.0,
    freeze_batchnorm: bool = True,
    input_channels: int = 3,
    image_size: int = 224,
    **sizes,
) -> RegNet:
    """RegNetY-16GF with a fresh ``num_classes``-way classifier. ``image_size`` is
    accepted for the common interface: no parameter's shape depends on it. ``sizes``
    (``depths``, ``widths``, ...) make a reduced network (the tests')."""
    del image_size
    return RegNet(
        num_classes=num_classes,
        dropout_rate=dropout_rate,
        freeze_batchnorm=freeze_batchnorm,
        input_channels=input_channels,
        **sizes,
    )
