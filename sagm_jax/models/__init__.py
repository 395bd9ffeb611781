"""Models: Flax ResNets with torchvision ImageNet weights, DomainBed's MNIST CNN, MixStyle.

This package owns the networks and their weights:

  resnet                torchvision-exact ResNet-18/50 with DomainBed's head.
  mnist_cnn             DomainBed's four-conv CNN for the MNIST variants.
  mixstyle              MixStyle, switched on per call, with its own rng stream.
  torchvision_weights   reading checkpoints (.pth, .safetensors, .npz) and strict mapping.
  convert               `python -m sagm_jax.models.convert in.pth out.safetensors`.
  synthetic             seeded torchvision-shaped weights for the parity tests.

``create`` builds a network by name. Every network is called as
``model.apply(variables, images_nhwc, train=..., mixstyle=..., rngs={'dropout': k1,
'mixstyle': k2})`` and returns logits; with ``freeze_batchnorm=False`` a training
call also passes ``mutable=['batch_stats']``.
"""

from __future__ import annotations

import flax.linen as nn

from sagm_jax.models.mixstyle import MixStyle
from sagm_jax.models.mnist_cnn import MnistCNN
from sagm_jax.models.resnet import ARCHITECTURES, MIXSTYLE_STAGES, ResNet
from sagm_jax.models.torchvision_weights import (
    convert_torchvision,
    file_sha256,
    imagenet_classifier,
    load_weights,
    save_weights,
    with_pretrained_backbone,
)

# The one list of architecture names (what ``create`` builds); the config checks import it.
ARCHS = (*ARCHITECTURES, "mnist_cnn")

__all__ = [
    "ARCHS",
    "MixStyle",
    "MnistCNN",
    "ResNet",
    "convert_torchvision",
    "create",
    "file_sha256",
    "imagenet_classifier",
    "load_weights",
    "save_weights",
    "with_pretrained_backbone",
]


def create(
    arch: str,
    num_classes: int,
    *,
    dropout_rate: float = 0.0,
    freeze_batchnorm: bool = True,
    mixstyle_after: tuple[int, ...] = (),
    input_channels: int = 3,
    cnn_widths: tuple[int, ...] | None = None,
) -> nn.Module:
    """The network ``arch`` (one of ``ARCHS``) with a fresh ``num_classes``-way classifier.

    ``cnn_widths`` sets the MNIST CNN's four conv widths (DomainBed's by default).
    ``freeze_batchnorm`` and ``mixstyle_after`` (stages from 1, 2, 3) apply to the
    ResNets; the MNIST CNN has GroupNorm and no MixStyle, so it rejects a
    non-empty ``mixstyle_after``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {list(ARCHS)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    mixstyle_after = tuple(sorted(set(mixstyle_after)))
    if arch == "mnist_cnn":
        if mixstyle_after:
            raise ValueError(
                f"mnist_cnn has no MixStyle layers; got mixstyle_after={mixstyle_after}"
            )
        widths = {} if cnn_widths is None else {"widths": tuple(cnn_widths)}
        return MnistCNN(
            num_classes=num_classes,
            dropout_rate=dropout_rate,
            input_channels=input_channels,
            **widths,
        )
    if bad := [stage for stage in mixstyle_after if stage not in MIXSTYLE_STAGES]:
        raise ValueError(f"mixstyle_after may only name ResNet stages {MIXSTYLE_STAGES}, got {bad}")
    return ResNet(
        arch=arch,
        num_classes=num_classes,
        dropout_rate=dropout_rate,
        freeze_batchnorm=freeze_batchnorm,
        mixstyle_after=mixstyle_after,
        input_channels=input_channels,
    )
