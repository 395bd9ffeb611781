"""Flax ResNet-18 and ResNet-50 that compute what torchvision's compute.

This module owns the ResNet architecture: torchvision's ``resnet18`` (basic
blocks) and ``resnet50`` (v1.5 bottlenecks: the stride sits on the 3x3 conv),
in the DomainBed configuration: torchvision's fc removed, dropout on the pooled
feature, a fresh linear classifier ``classifier``. With ``num_classes=1000`` and
the torchvision fc weights in ``classifier`` the network is torchvision's
ImageNet classifier (see ``torchvision_weights.imagenet_classifier``).

Written with Flax Linen because the training step must stay a pure function that
``jax.jit`` and sharding handle: ``model.apply(variables, x, ...)`` is exactly
such a function of the variables, the images and explicit PRNG keys, with no
hidden module state.

Padding. torchvision pads symmetrically: the 7x7 stem conv by 3, every 3x3 conv
by 1 (also at stride 2), the 3x3 stride-2 max-pool by 1 (with -inf). Flax's
'SAME' padding is asymmetric at stride 2 (it pads more on the bottom/right), which
shifts every sampling grid by one pixel, so every padding here is explicit.

BatchNorm. ``y = (x - mean) / sqrt(var + 1e-5) * scale + bias`` (torchvision's
eps). Frozen (the default, DomainBed's setting): ``mean`` and ``var`` are the
running statistics in training and evaluation alike and are never updated;
``scale`` and ``bias`` are ordinary trainable parameters. Trainable
(``freeze_batchnorm=False``): batch statistics in training, and the running
statistics are updated as ``running = 0.9 * running + 0.1 * batch`` (torch's
momentum 0.1); the caller passes ``mutable=['batch_stats']``. Flax updates the
running variance with the biased batch variance where torch uses the unbiased
one, a difference of a factor N / (N - 1) in that update only.

Variable names mirror torchvision's module names (``conv1``, ``bn1``,
``layer1_0/conv2``, ``layer2_0/downsample_conv``, ...), so the mapping to
torchvision's keys in ``torchvision_weights`` is mechanical.

Intermediate features. Each call sows (Flax's ``sow``, collection
:data:`INTERMEDIATES`) the stem's output (after the max-pool) as ``"stem"`` and each
stage's output (after its last block, before a MixStyle layer) as ``"block1"`` ..
``"block4"``: the outputs of torchvision's ``maxpool`` and ``layer1`` .. ``layer4``,
the features MIRO regularises (``khanrc/miro``, ``domainbed/networks/ur_networks.py``,
``URResNet``). ``sow`` stores nothing unless the caller passes
``mutable=[INTERMEDIATES]``, so the forward is unchanged otherwise.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax.linen.dtypes import promote_dtype

from sagm_jax.models.cpu_ops import conv_as_patches, max_pool, uses_patches
from sagm_jax.models.mixstyle import MixStyle

BATCHNORM_EPS = 1e-5
# torch's BatchNorm momentum 0.1 weighs the new batch; Flax's momentum weighs the old value.
BATCHNORM_MOMENTUM = 0.9

# arch -> (block kind, number of blocks in each of the four stages)
ARCHITECTURES: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
}
STAGE_WIDTHS = (64, 128, 256, 512)
EXPANSION = {"basic": 1, "bottleneck": 4}
MIXSTYLE_STAGES = (1, 2, 3)
# The collection the networks sow their intermediate features into (``mutable=[...]``).
INTERMEDIATES = "intermediates"

# torchvision's init for training from scratch: kaiming_normal_(fan_out, relu); JAX's "normal" is untruncated.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def check_images(x: jax.Array, input_channels: int, network: str) -> None:
    """Rejects anything but NHWC images with ``input_channels`` channels, naming the shape."""
    if x.ndim != 4:
        raise ValueError(f"{network} expects NHWC images of rank 4, got shape {x.shape}")
    if x.shape[-1] != input_channels:
        raise ValueError(
            f"{network} built for {input_channels} input channels got images of shape "
            f"{x.shape} (NHWC expected)"
        )


def torch_linear_init(fan_in: int):
    """torch.nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for kernel and bias."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class TracedDropout(nn.Dropout):
    """``nn.Dropout`` with a traced rate (the runs of a pack, ``sagm_jax.training.packed``,
    each with its own): the same draw as ``nn.Dropout``'s under the same name (its
    scope's ``dropout`` key, ``bernoulli(1 - rate)``, kept rows scaled by
    ``1 / (1 - rate)``), made even at rate 0, where it keeps every row: the identity, as
    the unpacked run that skips dropout."""

    @nn.compact
    def __call__(self, inputs, deterministic: bool | None = None, rng=None):
        if self.deterministic if deterministic is None else deterministic:
            return inputs
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.make_rng(self.rng_collection), keep, inputs.shape)
        return jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))


def classifier_head(
    x, num_classes: int, dropout_rate: float, train: bool, kernel_init=None, features=False
):
    """DomainBed's head on a feature map: global average pool, then :func:`linear_head`.
    Called inside a network's ``__call__``: its layers are the network's."""
    return linear_head(jnp.mean(x, axis=(1, 2)), num_classes, dropout_rate, train,
                       kernel_init=kernel_init, features=features)


def linear_head(
    feature, num_classes: int, dropout_rate: float, train: bool, kernel_init=None, features=False
):
    """DomainBed's head on a feature vector [B, D]: dropout -> ``classifier`` (a Dense
    layer with torch's ``nn.Linear`` init unless ``kernel_init`` is given). Called inside
    a network's ``__call__``: its layers are the network's. Returns the logits, or
    ``(features, logits)`` with ``features`` (the post-dropout vector, DomainBed's
    featurizer output that CORAL and MMD compare)."""
    if not isinstance(dropout_rate, (int, float)):  # traced: a pack's runs differ in it
        feature = TracedDropout(dropout_rate, deterministic=not train, name="Dropout_0")(feature)
    elif dropout_rate > 0.0:
        feature = nn.Dropout(dropout_rate, deterministic=not train)(feature)
    fan_in = feature.shape[-1]
    logits = nn.Dense(
        num_classes,
        kernel_init=kernel_init or torch_linear_init(fan_in),
        bias_init=torch_linear_init(fan_in),
        name="classifier",
    )(feature)
    return (feature, logits) if features else logits


def on_cpu() -> bool:
    """Whether to use ``cpu_ops``' forms; GPUs and TPUs keep XLA's own operations."""
    return jax.default_backend() == "cpu"


def conv(features: int, kernel: int, stride: int, name: str) -> "Conv":
    """A bias-free convolution padded symmetrically by kernel // 2, as torchvision's."""
    return Conv(features, kernel, stride, name=name)


class Conv(nn.Module):
    """``nn.Conv(features, (k, k), strides=stride, padding=k // 2, use_bias=False)``.

    Same parameter (``kernel``, HWIO, torchvision's init) and the same result up to
    float rounding; on the CPU, where XLA's convolution is slow (``uses_patches``), it
    is computed as a dot of patches instead (accelerators keep XLA's convolution).
    """

    features: int
    kernel: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k, stride, pad = self.kernel, self.stride, self.kernel // 2
        w = self.param("kernel", conv_init, (k, k, x.shape[-1], self.features))
        x, w = promote_dtype(x, w, dtype=None)
        size = min(x.shape[1:3])
        if on_cpu() and uses_patches(k, size, (size + 2 * pad - k) // stride + 1):
            return conv_as_patches(x, w, stride, pad)
        return jax.lax.conv_general_dilated(
            x, w, (stride, stride), ((pad, pad), (pad, pad)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )


def batchnorm(use_running_average: bool, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=use_running_average,
        momentum=BATCHNORM_MOMENTUM,
        epsilon=BATCHNORM_EPS,
        name=name,
    )


def shortcut(x, out_features: int, stride: int, use_running_average: bool):
    """A block's identity, or its 1x1 projection (torchvision's ``downsample``) when the
    block changes the shape. Called inside a block's ``__call__``: its layers are the
    block's."""
    if stride == 1 and x.shape[-1] == out_features:
        return x
    x = conv(out_features, 1, stride, "downsample_conv")(x)
    return batchnorm(use_running_average, "downsample_bn")(x)


class Block(nn.Module):
    """A residual block's settings: its width, its stride, and whether BatchNorm uses its
    running statistics."""

    width: int
    stride: int
    use_running_average: bool


class BasicBlock(Block):
    """Two 3x3 convs (the first strided) and a projection shortcut when the shape changes."""

    @nn.compact
    def __call__(self, x):
        out_features = self.width * EXPANSION["basic"]
        y = conv(self.width, 3, self.stride, "conv1")(x)
        y = nn.relu(batchnorm(self.use_running_average, "bn1")(y))
        y = conv(self.width, 3, 1, "conv2")(y)
        y = batchnorm(self.use_running_average, "bn2")(y)
        return nn.relu(y + shortcut(x, out_features, self.stride, self.use_running_average))


class Bottleneck(Block):
    """1x1 reduce, 3x3 (strided: v1.5), 1x1 expand by 4, projection shortcut when needed."""

    @nn.compact
    def __call__(self, x):
        out_features = self.width * EXPANSION["bottleneck"]
        y = conv(self.width, 1, 1, "conv1")(x)
        y = nn.relu(batchnorm(self.use_running_average, "bn1")(y))
        y = conv(self.width, 3, self.stride, "conv2")(y)
        y = nn.relu(batchnorm(self.use_running_average, "bn2")(y))
        y = conv(out_features, 1, 1, "conv3")(y)
        y = batchnorm(self.use_running_average, "bn3")(y)
        return nn.relu(y + shortcut(x, out_features, self.stride, self.use_running_average))


class ResNet(nn.Module):
    """torchvision's ResNet with DomainBed's head: pooled feature -> dropout -> classifier.

    Attributes:
      arch: a key of ``ARCHITECTURES``.
      num_classes: outputs of the fresh linear classifier.
      dropout_rate: dropout on the pooled feature in training (0 disables it).
      freeze_batchnorm: use and keep the running statistics (see module docstring).
      mixstyle_after: stages (from 1, 2, 3) after which a MixStyle layer sits.
      mixstyle_p, mixstyle_alpha: each MixStyle layer's probability and Beta parameter.
      mixstyle_mix: whose statistics a row mixes with ("random" or "crossdomain",
        ``sagm_jax.models.mixstyle``); mixstyle_domain_rows: crossdomain's rows per domain.
      input_channels: channels the images must have (3 for torchvision weights).
    """

    arch: str
    num_classes: int
    dropout_rate: float = 0.0
    freeze_batchnorm: bool = True
    mixstyle_after: Sequence[int] = ()
    mixstyle_p: float = 0.5
    mixstyle_alpha: float = 0.1
    mixstyle_mix: str = "random"
    mixstyle_domain_rows: int = 0
    input_channels: int = 3

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mixstyle: bool = False, features=False):
        """Logits [B, num_classes] for normalized NHWC float images ``x`` (with
        ``features``: ``(features [B, 2048 or 512], logits)``).

        ``mixstyle`` switches the MixStyle layers on for this call; they act only
        when ``train`` is also true (and are absent when ``mixstyle_after`` is empty).
        """
        check_images(x, self.input_channels, "ResNet")
        block_kind, stage_sizes = ARCHITECTURES[self.arch]
        block_class = BasicBlock if block_kind == "basic" else Bottleneck
        use_running_average = self.freeze_batchnorm or not train

        x = conv(64, 7, 2, "conv1")(x)
        x = nn.relu(batchnorm(use_running_average, "bn1")(x))
        if on_cpu():
            x = max_pool(x, 3, 2, 1)  # the same numbers, a CPU-friendly gradient (cpu_ops)
        else:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        self.sow(INTERMEDIATES, "stem", x)
        for stage, (width, blocks) in enumerate(zip(STAGE_WIDTHS, stage_sizes), start=1):
            for index in range(blocks):
                stride = 2 if stage > 1 and index == 0 else 1
                x = block_class(width, stride, use_running_average, name=f"layer{stage}_{index}")(x)
            self.sow(INTERMEDIATES, f"block{stage}", x)
            if stage in self.mixstyle_after:
                x = MixStyle(
                    self.mixstyle_p,
                    self.mixstyle_alpha,
                    mix=self.mixstyle_mix,
                    domain_rows=self.mixstyle_domain_rows,
                    name=f"mixstyle{stage}",
                )(x, active=train and mixstyle)
        return classifier_head(x, self.num_classes, self.dropout_rate, train, features=features)
