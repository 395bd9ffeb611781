"""Convert a backbone's weight file once into a file that needs no torch.

    python -m sagm_jax.models.convert resnet50-0676ba61.pth resnet50.safetensors
    python -m sagm_jax.models.convert model.safetensors resnet50_augmix.safetensors --layout timm
    python -m sagm_jax.models.convert resnet50.pth resnet50_barlowtwins.safetensors
    python -m sagm_jax.models.convert r-50-1000ep.pth.tar resnet50_moco.safetensors
    python -m sagm_jax.models.convert RN50.pt clip_resnet50.safetensors
    python -m sagm_jax.models.convert ViT-B-16.pt clip_vit-b16.safetensors
    python -m sagm_jax.models.convert dinov2_vitb14_pretrain.pth dinov2_vitb14.safetensors
    python -m sagm_jax.models.convert regnety_16gf.torch swag_regnety_16gf.safetensors

The other backbones' files (``backbones.BACKBONES``: CLIP's RN50 and ViT-B/16 towers,
OpenAI's TorchScript archives included, DINOv2's ViT-B/14, SWAG's RegNetY-16GF) keep
their own keys (CLIP's image tower only), checked strictly by the backbone's converter;
their layout is the backbone's name.

Run it on any machine with torch (``pip install 'sagm_jax[torch]'``) for a torch
file (.pth, .pt, .bin, .pth.tar); .safetensors and .npz sources need no torch. The
file's layout is detected from its keys, or named with ``--layout`` (``LAYOUTS``:
the ResNet layouts of ``resnet_layouts``: torchvision, timm, barlowtwins, mocov3).
The output (``.safetensors`` or ``.npz``, by its suffix) holds the weights in
torchvision's key layout (a torchvision or timm file's keys and arrays unchanged,
a MoCo v3 checkpoint's base encoder renamed), checked strictly before it is
written. The layout and the source file's SHA-256 are stored in the safetensors
metadata (``layout``, ``source_sha256``); the layout and both digests are printed,
so results can be traced to the original download.

``CONVERTERS`` dispatches by family: each ``Converter`` names the layouts it reads,
detects one from the keys, and prepares the state dict to write.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from sagm_jax.models import backbones, clip_resnet_weights, regnet_weights, vit_weights
from sagm_jax.models.resnet_layouts import RESNET_LAYOUTS, detect_resnet_layout, resnet_state_dict
from sagm_jax.models.torchvision_weights import (
    MAX_KEYS_IN_MESSAGE,
    infer_arch,
    load_weights,
    save_weights,
)


@dataclass(frozen=True)
class Converter:
    """One family of weight files: the layout names it reads, ``detect(state_dict)``
    (the layout the keys show, or None) and ``prepare(state_dict, layout)`` (the state
    dict to write, checked strictly, and metadata such as the arch)."""

    layouts: tuple[str, ...]
    detect: Callable[[Mapping[str, Any]], str | None]
    prepare: Callable[[Mapping[str, Any], str], tuple[dict, dict[str, str]]]


def _prepare_resnet(state_dict: Mapping[str, Any], layout: str) -> tuple[dict, dict[str, str]]:
    result, _ = resnet_state_dict(state_dict, layout)
    return result, {"arch": infer_arch(result)}


def _backbone(arch: str, detect: Callable, tower: Callable | None = None) -> Converter:
    """A backbone whose file keeps its reference framework's keys: its image tower
    (``tower``: CLIP's, from a whole CLIP model) checked strictly by the backbone's
    converter at 224x224 (``backbones.converter``) and written as it is."""

    def prepare(state_dict, layout):
        kept = dict(tower(state_dict) if tower else state_dict)
        backbones.converter(arch)(kept, image_size=224)  # strict: names the keys
        return kept, {"arch": arch}

    return Converter((arch,), lambda sd: arch if detect(sd) else None, prepare)


# In the order detection tries them: CLIP's RN50 before the ResNets, whose stem and block
# keys it shares (its attention pool tells it apart).
CONVERTERS: dict[str, Converter] = {
    "clip_resnet": _backbone("clip_resnet50", clip_resnet_weights.detect_clip_resnet,
                             clip_resnet_weights.image_tower),
    "clip_vit": _backbone("clip_vit-b16", vit_weights.detect_clip_vit,
                          vit_weights.clip_image_tower),
    "dinov2": _backbone("dinov2_vitb14", vit_weights.detect_dinov2),
    "regnet": _backbone("swag_regnety_16gf", regnet_weights.detect_regnet),
    "resnet": Converter(RESNET_LAYOUTS, detect_resnet_layout, _prepare_resnet),
}


def layouts() -> list[str]:
    """Every layout name ``--layout`` accepts."""
    return [name for converter in CONVERTERS.values() for name in converter.layouts]


def prepare(state_dict: Mapping[str, Any], layout: str | None = None):
    """``(state dict to write, layout name, metadata)``: the named layout, or the first
    one a converter detects; a ValueError naming the keys when none does."""
    if layout is None:
        for converter in CONVERTERS.values():
            if (layout := converter.detect(state_dict)) is not None:
                return _run(converter, state_dict, layout)
        keys = sorted(state_dict)
        more = len(keys) - MAX_KEYS_IN_MESSAGE
        raise ValueError(
            f"no converter recognises this state dict (layouts: {', '.join(layouts())}); "
            f"name one with --layout. Its {len(keys)} keys are "
            + ", ".join(keys[:MAX_KEYS_IN_MESSAGE])
            + (f" ... and {more} more" if more > 0 else "")
        )
    for converter in CONVERTERS.values():
        if layout in converter.layouts:
            return _run(converter, state_dict, layout)
    raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(layouts())}")


def _run(converter: Converter, state_dict: Mapping[str, Any], layout: str):
    result, metadata = converter.prepare(state_dict, layout)
    return result, layout, metadata


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "source", help="weight file (.pth, .pt, .bin, .pth.tar, .safetensors or .npz)"
    )
    parser.add_argument("target", help="output file, .safetensors or .npz")
    parser.add_argument(
        "--layout", choices=layouts(), default=None, help="the file's layout (default: detected)"
    )
    args = parser.parse_args(argv)
    state_dict, source_sha256 = load_weights(args.source)
    result, layout, metadata = prepare(state_dict, args.layout)
    how = "named" if args.layout else "detected"
    target_sha256 = save_weights(
        result,
        args.target,
        metadata={
            "source_sha256": source_sha256,
            "source_name": os.path.basename(args.source),
            "layout": layout,
            **metadata,
        },
    )
    print(f"layout {layout} ({how})")
    print(f"{metadata.get('arch', layout)}: {len(result)} arrays")
    print(f"source {args.source} sha256 {source_sha256}")
    print(f"target {args.target} sha256 {target_sha256}")


if __name__ == "__main__":
    main()
