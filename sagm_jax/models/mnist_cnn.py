"""DomainBed's small CNN for the MNIST variants (RotatedMNIST, ColoredMNIST).

This module owns that network. As in DomainBed's ``MNIST_CNN``, each of four
3x3 convolutions (64, 128, 128, 128 channels; the second has stride 2; all are
padded by 1 and carry a bias) is followed by ReLU and then GroupNorm with 8
groups (in that order: conv -> relu -> groupnorm), then a global average pool
gives a 128-d feature and a linear layer the logits. GroupNorm normalizes each
example's channels in groups of C/8 over the spatial axes and the group,

    y = (x - mean_group) / sqrt(var_group + 1e-5) * scale + bias,

with torch's eps 1e-5. Dropout on the feature is an option (off by default; it
is not in DomainBed) so the ResNet and this network take the same arguments.
Initialization mirrors torch's defaults for Conv2d and Linear
(U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bounds, kaiming-uniform with a = sqrt(5)).

Intermediate features: each call sows (collection ``resnet.INTERMEDIATES``) the output
of conv block k (conv -> relu -> groupnorm) as ``"block{k}"``, k = 1..4, the network's
counterpart of the ResNet's four stages (it has no separate stem), for MIRO (DomainBed's
MNIST networks are not in ``khanrc/miro``). Nothing is stored unless the caller asks
with ``mutable=[INTERMEDIATES]``.
"""

from __future__ import annotations

import jax
import flax.linen as nn

from sagm_jax.models.resnet import (
    INTERMEDIATES,
    check_images,
    classifier_head,
    torch_linear_init,
)

GROUPNORM_GROUPS = 8
GROUPNORM_EPS = 1e-5
# (output channels, stride) of the four convolutions
CONV_LAYERS = ((64, 1), (128, 2), (128, 1), (128, 1))
# torch's Conv2d/Linear default kernel init: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)).
torch_default_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class MnistCNN(nn.Module):
    """DomainBed's MNIST CNN.

    Attributes:
      num_classes: outputs of the linear head.
      dropout_rate: dropout on the 128-d feature in training (0 disables it).
      input_channels: channels of the images (1 RotatedMNIST, 2 ColoredMNIST).
      widths: output channels of the four convolutions; DomainBed's (64, 128, 128,
        128) by default. Narrower widths (multiples of 8, for GroupNorm) make the
        offline CPU demo fast; they are not DomainBed's network.
    """

    num_classes: int
    dropout_rate: float = 0.0
    input_channels: int = 1
    widths: tuple[int, ...] = tuple(features for features, _ in CONV_LAYERS)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mixstyle: bool = False, features=False):
        """Logits [B, num_classes] for NHWC images ``x`` (with ``features``:
        ``(features [B, widths[-1]], logits)``); ``mixstyle`` is accepted and ignored."""
        check_images(x, self.input_channels, "MnistCNN")
        if len(self.widths) != len(CONV_LAYERS) or any(w % GROUPNORM_GROUPS for w in self.widths):
            raise ValueError(
                f"MnistCNN widths must be {len(CONV_LAYERS)} multiples of "
                f"{GROUPNORM_GROUPS}, got {self.widths}"
            )
        for index, (width, (_, stride)) in enumerate(zip(self.widths, CONV_LAYERS), start=1):
            fan_in = 9 * x.shape[-1]
            x = nn.Conv(
                width,
                (3, 3),
                strides=(stride, stride),
                padding=((1, 1), (1, 1)),
                kernel_init=torch_default_kernel_init,
                bias_init=torch_linear_init(fan_in),
                name=f"conv{index}",
            )(x)
            x = nn.relu(x)
            x = nn.GroupNorm(
                num_groups=GROUPNORM_GROUPS, epsilon=GROUPNORM_EPS, name=f"groupnorm{index}"
            )(x)
            self.sow(INTERMEDIATES, f"block{index}", x)
        return classifier_head(
            x,
            self.num_classes,
            self.dropout_rate,
            train,
            kernel_init=torch_default_kernel_init,
            features=features,
        )
