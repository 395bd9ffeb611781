"""CLIP's ResNet-50 image tower in Flax, computing what open_clip's ``ModifiedResNet`` computes.

This module owns the network of OpenAI's CLIP ``RN50`` image tower (open_clip
``open_clip/modified_resnet.py`` ``ModifiedResNet``, the same network and state-dict keys
as OpenAI's ``clip/model.py``), in the DomainBed/MIRO configuration: the attention pool's
1024-d output is the featurizer output (MIRO's ``clip_resnet50``, ``n_outputs =
output_dim``), followed by DomainBed's dropout and a fresh linear ``classifier``.
Its weights (layout, conversion, detection) are in ``clip_resnet_weights``.

The network, for NHWC images ``x`` normalised by :data:`MEAN` / :data:`STD` (CLIP's):

* stem: three 3x3 convolutions, each padded by 1, each followed by BatchNorm and ReLU:
  ``conv1`` (stride 2, 3 -> w/2), ``conv2`` (w/2 -> w/2), ``conv3`` (w/2 -> w); then a
  2x2 average pool of stride 2 (w = ``width`` = 64);
* four stages of 3, 4, 6, 3 anti-aliased bottlenecks of widths w, 2w, 4w, 8w (out:
  4x). A bottleneck of stride s computes
  ``y = relu(bn1(conv1_1x1(x)))``, ``y = relu(bn2(conv2_3x3(y)))`` (stride 1, pad 1),
  ``y = avgpool_s(y)`` when s > 1, ``y = bn3(conv3_1x1(y))``, and returns
  ``relu(y + shortcut(x))``, where the shortcut, when the stride or the width changes,
  is ``bn(conv_1x1(avgpool_s(x)))`` (open_clip's ``downsample``: an ``AvgPool2d(s)``,
  a stride-1 1x1 convolution, a BatchNorm), else the identity. Only the first block of
  stages 2-4 has s = 2; every convolution has stride 1 except the stem's first.
* attention pool (``attnpool``, open_clip's ``AttentionPool2d``): the final map
  [B, g, g, D] (D = 32w = 2048, g = ``image_size // 32`` = 7) becomes the tokens
  ``z = [mean_p x_p, x_1, ..., x_{g*g}] + P`` (P: ``positional_embedding`` [g*g + 1, D]);
  one multi-head attention (``heads`` = 32 heads of D / heads dims each) whose only
  output kept is the first token's:
  ``q = z_0 Wq + bq``, ``k = z Wk + bk``, ``v = z Wv + bv`` split into heads,
  ``a_h = softmax_j(q_h . k_{h,j} / sqrt(D / heads))``, ``o_h = sum_j a_{h,j} v_{h,j}``,
  ``feature = concat_h(o_h) Wc + bc`` (``c_proj``, D -> ``output_dim`` = 1024).
  Only the first query is computed: the other tokens' outputs are discarded by the
  reference, and each output token depends on its own query alone.

Average pools (kernel = stride = s, no padding, floor) are computed as the mean of the
s x s blocks, which is torch's ``AvgPool2d(s)`` (rows and columns past the last whole
block are dropped). Convolutions use ``resnet.conv``: symmetric explicit padding of
kernel // 2, torch's, never Flax's asymmetric 'SAME'.

The attention pool's positional embedding fixes the grid, so the network takes images
of ``image_size`` (any size whose grid, ceil(size / 2) halved four times with floor, is
``image_size // 32``); others are refused with a message naming both sizes.

BatchNorm (eps 1e-5) as ``resnet.py``: frozen (``freeze_batchnorm=True``, DomainBed's
and MIRO's setting) uses the running statistics in training and evaluation and never
updates them; trainable uses batch statistics in training and updates the running ones
with torch's momentum 0.1 (``mutable=['batch_stats']``).

Intermediate features (collection ``resnet.INTERMEDIATES``, NHWC), as MIRO's
``BLOCKNAMES["clipresnet"]`` (``khanrc/miro``, ``domainbed/networks/ur_networks.py``)
hooks them: ``"stem"`` the stem's average pool output, ``"block1"`` .. ``"block4"`` the
outputs of ``layer1`` .. ``layer4``.

Variable names mirror open_clip's modules (``conv1``, ``bn1``, ``layer2_0/conv3``,
``layer2_0/downsample_conv``, ``attnpool/q_proj``, ...). A fresh network is initialised
as open_clip's ``init_parameters``: the attention projections ~ N(0, 1 / D), every
block's ``bn3`` scale 0, the positional embedding ~ N(0, 1 / D).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from sagm_jax.models.resnet import (
    BATCHNORM_EPS,
    BATCHNORM_MOMENTUM,
    INTERMEDIATES,
    batchnorm,
    check_images,
    conv,
    linear_head,
    torch_linear_init,
)

# CLIP's preprocessing (open_clip constants.py OPENAI_DATASET_MEAN / OPENAI_DATASET_STD).
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
FEATURE_DIM = 1024  # the attention pool's output, MIRO's n_outputs for clip_resnet50
FEATURE_MAPS = True

# RN50 (open_clip model_configs/RN50.json): blocks per stage, stem/stage width, heads.
LAYERS = (3, 4, 6, 3)
WIDTH = 64
HEADS = 32  # open_clip: width * 32 // head_width (64)
EXPANSION = 4
NAME = "CLIPResNet"


def avg_pool(x: jax.Array, size: int) -> jax.Array:
    """torch's ``AvgPool2d(size)`` on NHWC ``x``: the mean of each size x size block
    (stride = size, no padding; trailing rows/columns that fill no block dropped)."""
    if size == 1:
        return x
    b, h, w, c = x.shape
    oh, ow = h // size, w // size
    x = x[:, : oh * size, : ow * size]
    return x.reshape(b, oh, size, ow, size, c).mean(axis=(2, 4))


def grid_size(image_size: int) -> int:
    """The side of the final map for images of ``image_size``: the stride-2 stem conv
    (ceil), then four 2x2 average pools (floor): the stem's and stages 2-4's."""
    side = (image_size + 1) // 2
    for _ in range(4):
        side //= 2
    return side


def _bn(use_running_average: bool, name: str, zero_scale: bool = False) -> nn.BatchNorm:
    if not zero_scale:
        return batchnorm(use_running_average, name)
    return nn.BatchNorm(
        use_running_average=use_running_average,
        momentum=BATCHNORM_MOMENTUM,
        epsilon=BATCHNORM_EPS,
        scale_init=nn.initializers.zeros,
        name=name,
    )


class CLIPBottleneck(nn.Module):
    """open_clip's ``Bottleneck``: strides by average pooling after the 3x3 conv (and
    before the shortcut's 1x1 conv), never by a strided convolution."""

    width: int
    stride: int
    use_running_average: bool

    @nn.compact
    def __call__(self, x):
        out_features = self.width * EXPANSION
        ura = self.use_running_average
        y = nn.relu(_bn(ura, "bn1")(conv(self.width, 1, 1, "conv1")(x)))
        y = nn.relu(_bn(ura, "bn2")(conv(self.width, 3, 1, "conv2")(y)))
        y = avg_pool(y, self.stride)
        y = _bn(ura, "bn3", zero_scale=True)(conv(out_features, 1, 1, "conv3")(y))
        if self.stride > 1 or x.shape[-1] != out_features:
            x = conv(out_features, 1, 1, "downsample_conv")(avg_pool(x, self.stride))
            x = _bn(ura, "downsample_bn")(x)
        return nn.relu(y + x)


class AttentionPool(nn.Module):
    """open_clip's ``AttentionPool2d``: the first token's output of one multi-head
    attention over [mean token, map tokens] + positional embedding (module docstring)."""

    grid: int
    heads: int
    output_dim: int

    @nn.compact
    def __call__(self, x):
        b, h, w, d = x.shape
        if d % self.heads:
            raise ValueError(f"{NAME}: {d} channels do not split into {self.heads} heads")
        std_init = nn.initializers.normal(stddev=d**-0.5)
        positional = self.param("positional_embedding", std_init, (self.grid**2 + 1, d))
        tokens = x.reshape(b, h * w, d)
        tokens = jnp.concatenate([tokens.mean(axis=1, keepdims=True), tokens], axis=1)
        tokens = tokens + positional.astype(tokens.dtype)

        def project(name, inputs, features):
            return nn.Dense(
                features, kernel_init=std_init, bias_init=torch_linear_init(d), name=name
            )(inputs)

        head_dim = d // self.heads
        query = project("q_proj", tokens[:, 0], d).reshape(b, self.heads, head_dim)
        keys = project("k_proj", tokens, d).reshape(b, h * w + 1, self.heads, head_dim)
        values = project("v_proj", tokens, d).reshape(b, h * w + 1, self.heads, head_dim)
        logits = jnp.einsum("bhe,bjhe->bhj", query, keys) / math.sqrt(head_dim)
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(values.dtype)
        pooled = jnp.einsum("bhj,bjhe->bhe", weights, values).reshape(b, d)
        return project("c_proj", pooled, self.output_dim)


class CLIPResNet(nn.Module):
    """CLIP's ResNet image tower with DomainBed's head: attention-pool feature ->
    dropout -> classifier.

    Attributes:
      num_classes: outputs of the fresh linear classifier.
      dropout_rate: dropout on the feature in training (0 disables it; may be traced).
      freeze_batchnorm: use and keep the running statistics (module docstring).
      input_channels: channels the images must have (3 for CLIP's weights).
      image_size: the image side the attention pool's positional embedding is for.
      layers, width, heads, output_dim: the architecture (RN50's by default; smaller
        values give a reduced variant of the same network).
    """

    num_classes: int
    dropout_rate: float = 0.0
    freeze_batchnorm: bool = True
    input_channels: int = 3
    image_size: int = 224
    layers: Sequence[int] = LAYERS
    width: int = WIDTH
    heads: int = HEADS
    output_dim: int = FEATURE_DIM

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mixstyle: bool = False, features=False):
        """Logits [B, num_classes] for normalised NHWC float images ``x`` (with
        ``features``: ``(feature [B, output_dim], logits)``). ``mixstyle`` is ignored."""
        check_images(x, self.input_channels, NAME)
        grid = self.image_size // 32
        if grid < 1 or grid_size(x.shape[1]) != grid or grid_size(x.shape[2]) != grid:
            raise ValueError(
                f"{NAME} built for image_size={self.image_size} (a {grid}x{grid} grid at its "
                f"attention pool) got images of {x.shape[1]}x{x.shape[2]} (a "
                f"{grid_size(x.shape[1])}x{grid_size(x.shape[2])} grid); build it with the "
                f"images' side as image_size"
            )
        ura = self.freeze_batchnorm or not train
        half = self.width // 2
        for index, out in enumerate((half, half, self.width), start=1):
            x = conv(out, 3, 2 if index == 1 else 1, f"conv{index}")(x)
            x = nn.relu(_bn(ura, f"bn{index}")(x))
        x = avg_pool(x, 2)
        self.sow(INTERMEDIATES, "stem", x)
        for stage, blocks in enumerate(self.layers, start=1):
            width = self.width * 2 ** (stage - 1)
            for index in range(blocks):
                stride = 2 if stage > 1 and index == 0 else 1
                x = CLIPBottleneck(width, stride, ura, name=f"layer{stage}_{index}")(x)
            self.sow(INTERMEDIATES, f"block{stage}", x)
        feature = AttentionPool(grid, self.heads, self.output_dim, name="attnpool")(x)
        return linear_head(feature, self.num_classes, self.dropout_rate, train, features=features)


def build(
    num_classes: int,
    *,
    dropout_rate=0.0,
    freeze_batchnorm=True,
    input_channels=3,
    image_size=224,
    **sizes,
) -> nn.Module:
    """CLIP's RN50 image tower with a fresh ``num_classes``-way classifier (DomainBed's
    head on the 1024-d attention-pool feature), for images of ``image_size``; ``sizes``
    (``layers``, ``width``, ``heads``, ``output_dim``) make a reduced network (the tests')."""
    if image_size < 32:
        raise ValueError(f"{NAME} needs images of at least 32x32, got image_size={image_size}")
    return CLIPResNet(
        num_classes=num_classes,
        dropout_rate=dropout_rate,
        freeze_batchnorm=freeze_batchnorm,
        input_channels=input_channels,
        image_size=image_size,
        **sizes,
    )
