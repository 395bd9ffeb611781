"""Models: the backbones (ResNets, CLIP, DINOv2, RegNetY) with their weights, DomainBed's
MNIST CNN, MixStyle.

This package owns the networks and their weights:

  backbones             the table of ``config.arch`` names: network, weight file, input
                        normalisation, featurizer width.
  resnet                torchvision-exact ResNet-18/50 with DomainBed's head.
  resnet_layouts        other ResNet-50 weight files (timm's AugMix, Barlow Twins, MoCo v3).
  clip_resnet           CLIP's ResNet-50 image tower (open_clip's ModifiedResNet).
  vit                   CLIP's ViT-B/16 image tower and DINOv2's ViT-B/14.
  regnet                RegNetY-16GF (torchvision's RegNet; SWAG's weights).
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
import jax
import jax.numpy as jnp

from sagm_jax.models import backbones
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
ARCHS = tuple(backbones.BACKBONES)

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
    image_size: int = 224,
    imagenet_inputs: bool = False,
) -> nn.Module:
    """The network ``arch`` (one of ``ARCHS``, ``backbones.BACKBONES``) with a fresh
    ``num_classes``-way classifier.

    ``cnn_widths`` sets the MNIST CNN's four conv widths (DomainBed's by default).
    ``freeze_batchnorm`` applies to the networks with BatchNorm; ``mixstyle_after``
    (stages from 1, 2, 3) and the MixStyle layers' probability ``mixstyle_p``, Beta
    parameter ``mixstyle_alpha`` and pairing ``mixstyle_mix`` ("random", or
    "crossdomain" over domains of ``mixstyle_domain_rows`` rows each:
    ``sagm_jax.models.mixstyle``) to the ResNets only; the others reject a non-empty
    ``mixstyle_after``. ``image_size`` sizes the positional embeddings of the networks
    that have them. ``imagenet_inputs``: the images come normalised with ImageNet's
    statistics, so a backbone with others (CLIP's) maps them first
    (``backbones.renormalising``).
    """
    backbone = backbones.get(arch)
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    mixstyle_after = tuple(sorted(set(mixstyle_after)))
    if mixstyle_after and not backbone.mixstyle:
        raise ValueError(f"{arch} has no MixStyle layers (MixStyle sits between the stages of "
                         f"the ResNets); got mixstyle_after={mixstyle_after}")
    head = dict(num_classes=num_classes, dropout_rate=dropout_rate, input_channels=input_channels)
    if arch == "mnist_cnn":
        widths = {} if cnn_widths is None else {"widths": tuple(cnn_widths)}
        return MnistCNN(**head, **widths)
    if not backbone.mixstyle:
        network = backbones.build(arch, freeze_batchnorm=freeze_batchnorm,
                                  image_size=image_size, **head)
        affine = backbones.input_affine(backbone) if imagenet_inputs else None
        return backbones.renormalising(network, affine) if affine else network
    if bad := [stage for stage in mixstyle_after if stage not in MIXSTYLE_STAGES]:
        raise ValueError(f"mixstyle_after may only name ResNet stages {MIXSTYLE_STAGES}, got {bad}")
    if mixstyle_mix not in MIXES:
        raise ValueError(f"mixstyle_mix={mixstyle_mix!r}: expected one of {', '.join(MIXES)}")
    return ResNet(
        arch=backbone.network,
        freeze_batchnorm=freeze_batchnorm,
        mixstyle_after=mixstyle_after,
        mixstyle_p=mixstyle_p,
        mixstyle_alpha=mixstyle_alpha,
        mixstyle_mix=mixstyle_mix,
        mixstyle_domain_rows=mixstyle_domain_rows,
        **head,
    )


def convert_resnet(state_dict, arch: str) -> dict:
    """A ResNet weight file as our variables: its key layout (``resnet_layouts``: a
    torchvision, timm, Barlow Twins or MoCo v3 file, or one ``models.convert`` wrote)
    detected from its keys, so a raw download and its converted file load alike."""
    from sagm_jax.models.resnet_layouts import resnet_state_dict

    torchvision_state_dict, _ = resnet_state_dict(state_dict)
    return convert_torchvision(torchvision_state_dict, arch=arch)


def from_config(config, num_classes: int, input_shape, key, pretrained: bool = True,
                imagenet_inputs: bool = False):
    """The network and its variables (input ``[1, *input_shape]``), with the pretrained
    backbone of ``config.pretrained_weights`` unless ``pretrained=False`` (the caller
    restores a checkpoint instead). ``imagenet_inputs``: the dataset's images come
    normalised with ImageNet's statistics (the image folders), see :func:`create`.
    Returns ``(model, variables, weights_info)``."""
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
        image_size=input_shape[0],
        imagenet_inputs=imagenet_inputs,
    )
    # Jitted: one compilation of the whole initialisation, not one per operation (a
    # network's first eager init compiles each of its hundreds of distinct operations).
    variables = jax.jit(
        lambda k: model.init(k, jnp.zeros((1, *input_shape), jnp.float32), train=False)
    )(key)
    weights = {"file": None, "sha256": None}
    if pretrained and config.pretrained_weights and config.pretrained_weights.lower() != "none":
        state_dict, sha256 = load_weights(config.pretrained_weights)
        try:
            converted = backbones.converter(config.arch)(state_dict, image_size=input_shape[0])
            variables = with_pretrained_backbone(variables, converted)
        except ValueError as error:
            raise ValueError(f"{config.pretrained_weights}: {error}") from None
        weights = {"file": os.path.abspath(config.pretrained_weights), "sha256": sha256}
    return model, variables, weights
