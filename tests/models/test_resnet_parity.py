"""Our ResNets against torchvision's own logits (golden file from experiments/make_resnet_golden.py).

The weights and images are regenerated from sagm_jax.models.synthetic, the same
code the golden script used; the golden logits come from torchvision's resnet18
and resnet50 in eval mode. No torch is needed here.
"""

import os

import jax
import numpy as np
import pytest

from sagm_jax import models
from sagm_jax.models.synthetic import (
    GOLDEN_BATCH as BATCH,
    GOLDEN_IMAGE_SEED as IMAGE_SEED,
    GOLDEN_SIZES,
    GOLDEN_WEIGHT_SEEDS as WEIGHT_SEED,
    draw_images,
    draw_torchvision_weights,
    weights_fingerprint,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_resnet.npz")
TOLERANCE = 1e-4  # max |ours - torchvision| relative to max |torchvision|


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN) as archive:
        return {key: archive[key] for key in archive.files}


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_logits_match_torchvision(arch, golden):
    weights = draw_torchvision_weights(arch, WEIGHT_SEED[arch])
    assert weights_fingerprint(weights) == str(golden[f"{arch}_fingerprint"]), (
        "the drawn weights differ from those the golden file was made with "
        "(NumPy's generator changed?); rerun experiments/make_resnet_golden.py"
    )
    variables = models.convert_torchvision(weights, arch=arch)
    model = models.create(arch, num_classes=1000)
    forward = jax.jit(lambda v, x: model.apply(v, x, train=False))
    assert any(size % 32 for size in GOLDEN_SIZES), "keep a size that is not a multiple of 32"
    for size in GOLDEN_SIZES:
        images = draw_images(IMAGE_SEED + size, BATCH, size).transpose(0, 2, 3, 1)
        with jax.default_matmul_precision("float32"):
            logits = np.asarray(forward(variables, images))
        reference = golden[f"{arch}_{size}"]
        assert logits.shape == reference.shape == (BATCH, 1000)
        error = np.abs(logits - reference).max() / np.abs(reference).max()
        print(f"{arch} {size}x{size}: max relative error {error:.2e}")
        assert error < TOLERANCE, f"{arch} at {size}x{size}: relative error {error:.2e}"


def test_imagenet_classifier_matches_torchvision(golden):
    weights = draw_torchvision_weights("resnet18", WEIGHT_SEED["resnet18"])
    classify = models.imagenet_classifier("resnet18", weights)
    images = draw_images(IMAGE_SEED + 64, BATCH, 64).transpose(0, 2, 3, 1)
    with jax.default_matmul_precision("float32"):
        logits = np.asarray(classify(images))
    reference = golden["resnet18_64"]
    assert np.abs(logits - reference).max() / np.abs(reference).max() < TOLERANCE
