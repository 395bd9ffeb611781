"""The table of backbones (``sagm_jax.models.backbones``) against the networks it names."""

import importlib

import pytest

from sagm_jax.models import backbones

# arch -> (module, the module's constants' prefix)
MODULES = {
    "clip_resnet50": ("sagm_jax.models.clip_resnet", ""),
    "clip_vit-b16": ("sagm_jax.models.vit", "CLIP_"),
    "dinov2_vitb14": ("sagm_jax.models.vit", "DINOV2_"),
    "swag_regnety_16gf": ("sagm_jax.models.regnet", ""),
}


@pytest.mark.parametrize("arch", list(MODULES))
def test_the_table_says_what_each_network_module_says(arch):
    """Normalisation, featurizer width and feature maps, written beside each network by
    its reference (open_clip's constants, torchvision's transforms, DomainBed's and
    MIRO's n_outputs), are the table's."""
    name, prefix = MODULES[arch]
    module = importlib.import_module(name)
    backbone = backbones.get(arch)
    assert backbone.mean == getattr(module, prefix + "MEAN")
    assert backbone.std == getattr(module, prefix + "STD")
    assert backbone.feature_dim == getattr(module, prefix + "FEATURE_DIM")
    assert backbone.feature_maps == getattr(module, prefix + "FEATURE_MAPS")
    assert callable(backbones.converter(arch))


def test_an_unknown_arch_names_the_known_ones():
    with pytest.raises(ValueError, match="'vgg16'.*resnet50_augmix.*swag_regnety_16gf"):
        backbones.get("vgg16")
