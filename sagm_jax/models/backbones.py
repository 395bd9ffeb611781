"""The backbones a run can train (``config.arch``), each with its weights and its input.

This module owns the table of backbones: for each ``config.arch`` name, the network
it builds (a module path, imported on first use), the weight file it starts from
(published name, URL, and the converter that maps the reference framework's
``state_dict`` onto our variables), its input normalisation and its featurizer width.

Names follow the reference code: ``resnet18``/``resnet50`` (torchvision, the paper's),
``resnet50_augmix`` (DomainBed HEAD's ``resnet50_augmix``: timm's ``resnet50.ram_in1k``),
``resnet50_barlowtwins``, ``resnet50_moco``, ``clip_resnet50``, ``clip_vit-b16`` and
``swag_regnety_16gf`` (khanrc/miro ``domainbed/networks/backbones.py``,
``get_backbone``), ``dinov2_vitb14`` (DomainBed HEAD ``domainbed/networks.py``,
``DinoV2``), and ``mnist_cnn`` (DomainBed's MNIST network, no weights).

Input normalisation. Every image dataset's pipeline normalises with ImageNet's mean and
std (``data.device_augment``, ``data.augment``, ``training.loading``). A backbone
trained with other statistics (CLIP's) maps its input first, per channel c:

    x_b = (x * std_in[c] + mean_in[c] - mean_b[c]) / std_b[c]

the same image as CLIP's own preprocessing gives (up to float rounding), so each
backbone sees the input its weights were trained on, and every other part of the code
(augmentation, evaluation, ``load_run``) stays as it is. MNIST-like data is not
normalised, and is not mapped.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import flax.linen as nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Backbone:
    """One ``config.arch``: what it builds, where its weights come from, what it takes."""

    name: str
    network: str  # a ResNet's ``resnet.ARCHITECTURES`` key, or "module:function" (``build``)
    convert: str | None  # "module:function": (state_dict, image_size) -> variables
    weights_file: str | None  # the published file's name (None: no weights)
    weights_url: str | None
    source: str  # whose weights, in words (for messages and the README)
    feature_dim: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    feature_maps: bool = True  # a CNN with spatial stage outputs (MixStyle, ...)
    mixstyle: bool = False  # MixStyle layers between its stages (the ResNets)
    min_image_size: int = 32  # the network's total stride (or its patch)
    batchnorm: bool = True  # has BatchNorm layers (``freeze_batchnorm`` applies)
    layout: str | None = None  # a ResNet's published file's key layout (``resnet_layouts``)
    # Keyword arguments for the builder beyond ``build``'s (a reduced-size variant's
    # widths and depths, as the tests register them); the published network takes none.
    options: tuple[tuple[str, object], ...] = ()


def _resnet(name, weights_file, url, source, feature_dim=2048, layout="torchvision"):
    network = "resnet18" if feature_dim == 512 else "resnet50"
    return Backbone(name, network, "sagm_jax.models:convert_resnet", weights_file, url, source,
                    feature_dim, mixstyle=True, layout=layout)


BACKBONES = {
    backbone.name: backbone
    for backbone in (
        _resnet("resnet18", "resnet18-f37072fd.pth",
                "https://download.pytorch.org/models/resnet18-f37072fd.pth",
                "torchvision's ImageNet ResNet-18 (IMAGENET1K_V1)", feature_dim=512),
        _resnet("resnet50", "resnet50-0676ba61.pth",
                "https://download.pytorch.org/models/resnet50-0676ba61.pth",
                "torchvision's ImageNet ResNet-50 (IMAGENET1K_V1), the paper's"),
        _resnet("resnet50_augmix", "model.safetensors",
                "https://huggingface.co/timm/resnet50.ram_in1k/resolve/main/model.safetensors",
                "timm's resnet50.ram_in1k (AugMix), DomainBed HEAD's default", layout="timm"),
        _resnet("resnet50_barlowtwins", "resnet50.pth",
                "https://dl.fbaipublicfiles.com/barlowtwins/ljng/resnet50.pth",
                "Barlow Twins' ResNet-50 (facebookresearch/barlowtwins)", layout="barlowtwins"),
        _resnet("resnet50_moco", "r-50-1000ep.pth.tar",
                "https://dl.fbaipublicfiles.com/moco-v3/r-50-1000ep/r-50-1000ep.pth.tar",
                "MoCo v3's ResNet-50, 1000 epochs (facebookresearch/moco-v3)", layout="mocov3"),
        Backbone("clip_resnet50", "sagm_jax.models.clip_resnet:build",
                 "sagm_jax.models.clip_resnet_weights:convert_clip_resnet", "RN50.pt",
                 "https://openaipublic.azureedge.net/clip/models/afeb0e10bbd5e1f6b7b9bc1ac63c1a4e"
                 "6d79c2a63bb94fa2b84c39a4d3e8cbc8/RN50.pt",
                 "OpenAI's CLIP RN50 image tower", 1024, CLIP_MEAN, CLIP_STD),
        Backbone("clip_vit-b16", "sagm_jax.models.vit:build_clip_vit_b16",
                 "sagm_jax.models.vit_weights:convert_clip_vit", "ViT-B-16.pt",
                 "https://openaipublic.azureedge.net/clip/models/5806e77cd80f8b59890b7e101eabd078"
                 "d9fb84e6937f9e85e4ecb61988df416f/ViT-B-16.pt",
                 "OpenAI's CLIP ViT-B/16 image tower", 512, CLIP_MEAN, CLIP_STD,
                 feature_maps=False, min_image_size=16, batchnorm=False),
        Backbone("dinov2_vitb14", "sagm_jax.models.vit:build_dinov2_vit_b14",
                 "sagm_jax.models.vit_weights:convert_dinov2", "dinov2_vitb14_pretrain.pth",
                 "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/dinov2_vitb14_pretrain.pth",
                 "DINOv2 ViT-B/14 (facebookresearch/dinov2), DomainBed HEAD's dinov2", 5 * 768,
                 feature_maps=False, min_image_size=14, batchnorm=False),
        Backbone("swag_regnety_16gf", "sagm_jax.models.regnet:build",
                 "sagm_jax.models.regnet_weights:convert_regnet", "regnety_16gf.torch",
                 "https://dl.fbaipublicfiles.com/SWAG/regnety_16gf.torch",
                 "SWAG's RegNetY-16GF (facebookresearch/SWAG), MIRO's strongest backbone", 3024),
        Backbone("mnist_cnn", "mnist_cnn", None, None, None,
                 "no weights (DomainBed's MNIST network)", 128, min_image_size=1, batchnorm=False),
    )
}


def get(arch: str) -> Backbone:
    """The backbone named ``arch``; a ValueError naming the accepted names otherwise."""
    if arch not in BACKBONES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(BACKBONES)}")
    return BACKBONES[arch]


def _resolve(target: str) -> Callable:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def converter(arch: str) -> Callable:
    """``(state_dict, image_size) -> {'params', 'batch_stats'}`` for ``arch``'s weights."""
    backbone = get(arch)
    if backbone.convert is None:
        raise ValueError(f"config.arch={arch} takes no pretrained weights")
    convert = _resolve(backbone.convert)
    if backbone.layout:  # a ResNet: the network's depth, the file's layout from its keys
        return lambda state_dict, image_size=224: convert(state_dict, arch=backbone.network)
    return convert


def input_affine(backbone: Backbone) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(scale, shift) per channel mapping ImageNet-normalised inputs to ``backbone``'s
    normalisation (module docstring), or None when it is ImageNet's."""
    if (backbone.mean, backbone.std) == (IMAGENET_MEAN, IMAGENET_STD):
        return None
    scale = tuple(s_in / s for s_in, s in zip(IMAGENET_STD, backbone.std))
    shift = tuple((m_in - m) / s for m_in, m, s in zip(IMAGENET_MEAN, backbone.mean, backbone.std))
    return scale, shift


_RENORMALISING: dict[type, type] = {}


def renormalising(network: nn.Module, affine) -> nn.Module:
    """``network`` with its input mapped by ``affine`` (:func:`input_affine`) first: the
    same variables (a subclass, not a wrapper), so the weights' paths are unchanged."""
    cls = type(network)
    if cls not in _RENORMALISING:

        def __call__(self, x, *args, **kwargs):
            scale, shift = self.input_affine
            x = x * _channels(scale, x) + _channels(shift, x)
            return cls.__call__(self, x, *args, **kwargs)

        _RENORMALISING[cls] = type(
            f"Renormalised{cls.__name__}", (cls,),
            {"__annotations__": {"input_affine": tuple}, "input_affine": ((1.0,) * 3, (0.0,) * 3),
             "__call__": __call__, "__module__": __name__},
        )
    fields = {name: getattr(network, name) for name in network.__dataclass_fields__
              if name not in ("parent", "name")}
    return _RENORMALISING[cls](**fields, input_affine=affine)


def trains_with_attention_only(params) -> dict:
    """DomainBed HEAD's ``vit_attn_tune`` (``domainbed/networks.py``, ``DinoV2``: a
    backbone parameter trains iff ``'attn' in name``) as a tree of bools over ``params``:
    True for the parameters whose path names ``attn`` (the ViTs' attention layers, named
    so in ``vit``), for the classifier and for the method's own modules (not part of the
    backbone in the reference either); False for every other backbone parameter."""
    import jax

    def trains(path, _):
        names = [str(getattr(entry, "key", entry)) for entry in path]
        return names[0] in ("classifier", "method") or any("attn" in n for n in names)

    return jax.tree_util.tree_map_with_path(trains, params)


def _channels(values, x):
    import jax.numpy as jnp

    return jnp.asarray(values, x.dtype)


def build(arch: str, num_classes: int, **options) -> nn.Module:
    """The network of a backbone that is not a ResNet nor the MNIST CNN (those are built
    by ``models.create``), with a fresh ``num_classes``-way classifier; ``options``:
    ``dropout_rate``, ``freeze_batchnorm``, ``input_channels``, ``image_size``."""
    backbone = get(arch)
    return _resolve(backbone.network)(num_classes, **options, **dict(backbone.options))
