"""Models: Flax ResNets with torchvision ImageNet weights, DomainBed's MNIST CNN, MixStyle.

This package owns the networks and their weights:

  resnet                torchvision-exact ResNet-18/50 with DomainBed's head.
  mnist_cnn             DomainBed's four-conv CNN for the MNIST variants.
  mixstyle              MixStyle, switched on per call, with its own rng stream.
  torchvision_weights   which file each ResNet starts from and its URL; reading checkpoints
                        (.pth, .safetensors, .npz) and strict mapping.
  convert               `python -m sagm_jax.models.convert in.pth out.safetensors`.
  synthetic             seeded torchvision-shaped weights for the parity tests.

``create`` builds a network by name; ``from_config`` builds the run's network from the
model section of a config, with its variables and pretrained backbone. Every network is called as
``model.apply(variables, images_nhwc, train=..., mixstyle=..., rngs={'dropout': k1,
'mixstyle': k2})`` and returns logits (``features=True``: ``(features, logits)``); with ``freeze_batchnorm=False`` a training
call also passes ``mutable=['batch_stats']``.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax.numpy as jnp

from sagm_jax.models.mixstyle import MIXES, MixStyle
from sagm_jax.models.mnist_cnn import MnistCNN
from sagm_jax.models.resnet import ARCHITECTURES, MIXSTYLE_STAGES, ResNet
from sagm_jax.models.torchvision_weights import (
    WEIGHTS_FILES,
    convert_torchvision,
    file_sha256,
    imagenet_classifier,
    load_weights,
    save_weights,
    weights_url,
    with_pretrained_backbone,
)

# The one list of architecture names (what ``create`` builds); the config checks import it.
ARCHS = (*ARCHITECTURES, "mnist_cnn")

__all__ = [
    "ARCHS",
    "WEIGHTS_FILES",
    "MixStyle",
    "MnistCNN",
    "ResNet",
    "convert_torchvision",
    "create",
    "from_config",
    "file_sha256",
    "imagenet_classifier",
    "load_weights",
    "save_weights",
    "weights_url",
    "with_pretrained_backbone",
]


def create(
    arch: str,
    num_classes: int,
    *,
    dropout_rate: float = 0.0,
    freeze_batchnorm: bool = True,
    mixstyle_after: tuple[int, ...] = (),
    mixstyle_p: float = 0.5,
    mixstyle_alpha: float = 0.1,
    mixstyle_mix: str = "random",
    mixstyle_domain_rows: int = 0,
    input_channels: int = 3,
    cnn_widths: tuple[int, ...] | None = None,
) -> nn.Module:
    """The network ``arch`` (one of ``ARCHS``) with a fresh ``num_classes``-way classifier.

    ``cnn_widths`` sets the MNIST CNN's four conv widths (DomainBed's by default).
    ``freeze_batchnorm``, ``mixstyle_after`` (stages from 1, 2, 3) and the MixStyle
    layers' probability ``mixstyle_p``, Beta parameter ``mixstyle_alpha`` and pairing
    ``mixstyle_mix`` ("random", or "crossdomain" over domains of ``mixstyle_domain_rows``
    rows each: ``sagm_jax.models.mixstyle``) apply to the ResNets; the MNIST CNN has
    GroupNorm and no MixStyle, so it rejects a non-empty ``mixstyle_after``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {list(ARCHS)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    mixstyle_after = tuple(sorted(set(mixstyle_after)))
    head = dict(num_classes=num_classes, dropout_rate=dropout_rate, input_channels=input_channels)
    if arch == "mnist_cnn":
        if mixstyle_after:
            raise ValueError(
                f"mnist_cnn has no MixStyle layers; got mixstyle_after={mixstyle_after}"
            )
        widths = {} if cnn_widths is None else {"widths": tuple(cnn_widths)}
        return MnistCNN(**head, **widths)
    if bad := [stage for stage in mixstyle_after if stage not in MIXSTYLE_STAGES]:
        raise ValueError(f"mixstyle_after may only name ResNet stages {MIXSTYLE_STAGES}, got {bad}")
    if mixstyle_mix not in MIXES:
        raise ValueError(f"mixstyle_mix={mixstyle_mix!r}: expected one of {', '.join(MIXES)}")
    return ResNet(
        arch=arch,
        freeze_batchnorm=freeze_batchnorm,
        mixstyle_after=mixstyle_after,
        mixstyle_p=mixstyle_p,
        mixstyle_alpha=mixstyle_alpha,
        mixstyle_mix=mixstyle_mix,
        mixstyle_domain_rows=mixstyle_domain_rows,
        **head,
    )


def from_config(config, num_classes: int, input_shape, key, pretrained: bool = True):
    """The network and its variables (input ``[1, *input_shape]``), with the pretrained
    backbone of ``config.pretrained_weights`` unless ``pretrained=False`` (the caller
    restores a checkpoint instead). Returns ``(model, variables, weights_info)``."""
    model = create(
        config.arch,
        num_classes,
        dropout_rate=config.dropout,
        freeze_batchnorm=config.freeze_batchnorm,
        mixstyle_after=tuple(config.mixstyle_after) if config.mixstyle else (),
        mixstyle_p=config.mixstyle_p,
        mixstyle_alpha=config.mixstyle_alpha,
        # Runs written before crossdomain MixStyle existed read the random one.
        mixstyle_mix=config.get("mixstyle_mix", "random"),
        # The training batch is the M domains' minibatches of batch_per_env rows each.
        mixstyle_domain_rows=config.batch_per_env,
        input_channels=input_shape[-1],
        cnn_widths=tuple(config.cnn_widths),
    )
    variables = model.init(key, jnp.zeros((1, *input_shape), jnp.float32), train=False)
    weights = {"file": None, "sha256": None}
    if pretrained and config.pretrained_weights and config.pretrained_weights.lower() != "none":
        state_dict, sha256 = load_weights(config.pretrained_weights)
        converted = convert_torchvision(state_dict, arch=config.arch)
        variables = with_pretrained_backbone(variables, converted)
        weights = {"file": os.path.abspath(config.pretrained_weights), "sha256": sha256}
    return model, variables, weights
