"""ResNet-50 weight files that are not torchvision's own, mapped onto torchvision's keys.

This module owns the step between a ResNet weight file of another framework and
torchvision's state-dict layout, which ``torchvision_weights.convert_torchvision``
then maps onto our variables (``resnet.ResNet``). The networks are the same
ResNet-50 (v1.5: the stride of a downsampling bottleneck on its 3x3 convolution,
the shortcut projection a strided 1x1 convolution and BatchNorm, BatchNorm eps
1e-5); only the files differ. ``resnet_state_dict(state_dict, layout=None)``
returns ``(torchvision_state_dict, layout_name)`` for these layouts:

* ``"torchvision"``: torchvision's ``resnet50`` ``state_dict()``, as it is.
* ``"timm"``: timm's ``resnet50`` (``timm/models/resnet.py``, class ``ResNet`` with
  ``Bottleneck`` blocks and ``layers=(3, 4, 6, 3)``), whose ``resnet50.ram_in1k``
  weights (RandAugment + AugMix) DomainBed's ``ResNet`` loads when ``resnet50_augmix``
  is set. Its module names, parameter order and shapes are torchvision's exactly
  (``conv1``, ``bn1``, ``layerS.B.convK``/``bnK``, ``layerS.0.downsample.0``/``.1``,
  ``fc``), so its keys pass unchanged. Because nothing in the keys tells a timm file
  from a torchvision one, such a file is *detected* as ``"torchvision"``; naming
  ``"timm"`` records where the weights came from.
* ``"barlowtwins"``: the Barlow Twins backbone (``facebookresearch/barlowtwins``,
  ``resnet50.pth``): torchvision's keys without ``fc.*`` (its training model's
  ``fc`` is ``nn.Identity``). The result has no ``fc`` either, so it converts to
  variables without a ``classifier``.
* ``"mocov3"``: a MoCo v3 checkpoint (``facebookresearch/moco-v3``,
  ``r-50-1000ep.pth.tar``; ``load_weights`` returns its ``state_dict`` entry) with
  keys ``module.base_encoder.*``, ``module.momentum_encoder.*`` and
  ``module.predictor.*``. As moco-v3's ``main_lincls.py`` and khanrc/miro's
  ``domainbed/networks/backbones.py`` (``resnet50_moco``) do, only the keys that
  start with ``module.base_encoder`` and not with ``module.base_encoder.fc`` (the
  MLP projection head) are kept, without that prefix; everything else (the
  momentum encoder, the predictor, the projection head) is dropped. No ``fc``.

Detection (``detect_resnet_layout``), on the keys without ``*.num_batches_tracked``:
a key starting with ``module.base_encoder.`` means ``"mocov3"``; otherwise
torchvision's stem and first block (``conv1.weight``, ``layer1.0.conv1.weight``)
mean ``"torchvision"`` when an ``fc.*`` key is present and ``"barlowtwins"`` when
none is; anything else is refused with a ValueError naming the keys. Every result
is checked strictly (``convert_torchvision``: missing, unexpected or mis-shaped
keys are named), so a named layout that does not fit the file is refused too.
"""

from __future__ import annotations

from typing import Any, Mapping

from sagm_jax.models.torchvision_weights import (
    IGNORED_SUFFIX,
    MAX_KEYS_IN_MESSAGE,
    convert_torchvision,
    infer_arch,
)

RESNET_LAYOUTS = ("torchvision", "timm", "barlowtwins", "mocov3")
# Where each layout's weights come from, for messages and the convert command's help.
LAYOUT_SOURCES = {
    "torchvision": "torchvision resnet50 (IMAGENET1K_V1, resnet50-0676ba61.pth)",
    "timm": "timm resnet50.ram_in1k (model.safetensors or pytorch_model.bin)",
    "barlowtwins": "Barlow Twins resnet50.pth (torchvision keys without fc)",
    "mocov3": "MoCo v3 r-50-1000ep.pth.tar (module.base_encoder.*)",
}
MOCO_PREFIX = "module.base_encoder."
MOCO_HEAD = "module.base_encoder.fc"  # the projection MLP: fc.0 ... fc.4
STEM_KEYS = ("conv1.weight", "layer1.0.conv1.weight")


def _weight_keys(state_dict: Mapping[str, Any]) -> list[str]:
    return [key for key in state_dict if not key.endswith(IGNORED_SUFFIX)]


def _has_fc(state_dict: Mapping[str, Any]) -> bool:
    return any(key.startswith("fc.") for key in state_dict)


def detect_resnet_layout(state_dict: Mapping[str, Any]) -> str | None:
    """The layout the keys show (a timm file shows ``"torchvision"``), or None."""
    keys = _weight_keys(state_dict)
    if any(key.startswith(MOCO_PREFIX) for key in keys):
        return "mocov3"
    if all(key in state_dict for key in STEM_KEYS):
        return "torchvision" if _has_fc(state_dict) else "barlowtwins"
    return None


def detect_resnet(state_dict: Mapping[str, Any]) -> bool:
    """The keys look like one of ``RESNET_LAYOUTS``'s ResNet checkpoints."""
    return detect_resnet_layout(state_dict) is not None


def _unknown_layout(state_dict: Mapping[str, Any]) -> ValueError:
    keys = sorted(_weight_keys(state_dict))
    shown = ", ".join(keys[:MAX_KEYS_IN_MESSAGE]) or "(none)"
    more = len(keys) - MAX_KEYS_IN_MESSAGE
    return ValueError(
        f"state dict matches none of the ResNet layouts {', '.join(RESNET_LAYOUTS)}: "
        f"expected torchvision's keys ({', '.join(STEM_KEYS)}, ..., with or without "
        f"fc.weight/fc.bias) or MoCo v3's ({MOCO_PREFIX}*); its {len(keys)} keys are "
        f"{shown}" + (f" ... and {more} more" if more > 0 else "")
    )


def _mocov3_backbone(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The base encoder's keys without its projection head, the prefix removed."""
    return {
        key[len(MOCO_PREFIX) :]: value
        for key, value in state_dict.items()
        if key.startswith(MOCO_PREFIX) and not key.startswith(MOCO_HEAD)
    }


def _check_fc(state_dict: Mapping[str, Any], layout: str) -> None:
    with_fc = layout in ("torchvision", "timm")
    if _has_fc(state_dict) != with_fc:
        fc_keys = sorted(key for key in state_dict if key.startswith("fc."))
        raise ValueError(
            f"a {layout} ResNet state dict "
            + (
                "has the ImageNet classifier fc.weight and fc.bias; this one lacks them"
                if with_fc
                else f"has no fc (a backbone alone); this one has {', '.join(fc_keys)}"
            )
        )


def _read(state_dict: Mapping[str, Any], layout: str | None):
    """(torchvision state dict, layout name, our variables), checked strictly."""
    if layout is None:
        layout = detect_resnet_layout(state_dict)
        if layout is None:
            raise _unknown_layout(state_dict)
    elif layout not in RESNET_LAYOUTS:
        raise ValueError(f"unknown ResNet layout {layout!r}; expected one of {RESNET_LAYOUTS}")
    if layout == "mocov3":
        if not any(key.startswith(MOCO_PREFIX) for key in state_dict):
            raise _unknown_layout(state_dict)
        result = _mocov3_backbone(state_dict)
    else:
        result = dict(state_dict)
    _check_fc(result, layout)
    variables = convert_torchvision(result, arch=infer_arch(result))  # strict: names the keys
    return result, layout, variables


def resnet_state_dict(
    state_dict: Mapping[str, Any], layout: str | None = None
) -> tuple[dict[str, Any], str]:
    """``state_dict`` in torchvision's ResNet layout, and the layout name it was read as.

    ``layout`` is one of ``RESNET_LAYOUTS``, or None to detect it from the keys
    (``detect_resnet_layout``). The result is checked strictly against torchvision's
    ResNet (``convert_torchvision``); a ValueError names the offending keys.
    """
    result, layout, _ = _read(state_dict, layout)
    return result, layout


def convert_resnet(
    state_dict: Mapping[str, Any], layout: str | None = None
) -> tuple[dict[str, dict], str]:
    """Our ResNet variables (``{'params', 'batch_stats'}``, a ``classifier`` only when the
    file has an ``fc``) from any of ``RESNET_LAYOUTS``, and the layout name."""
    _, layout, variables = _read(state_dict, layout)
    return variables, layout
