"""Write timm's own ResNet-50 outputs on seeded weights and images to a golden file.

DomainBed's ``ResNet`` (``domainbed/networks.py``, hparam ``resnet50_augmix``) builds its
AugMix ResNet-50 with ``timm.create_model('resnet50.ram_in1k', pretrained=True)``; we load
those weights into our ResNet-50 in torchvision's layout (``resnet_layouts``). This
script shows that timm's network computes what ours does: it builds
``timm.create_model('resnet50.ram_in1k', pretrained=False)`` (timm's ``ResNet`` with
``Bottleneck`` blocks, ``timm/models/resnet.py``), checks that its ``state_dict()`` keys,
order and shapes are exactly ``torchvision_layout('resnet50')``, loads the seeded
weights of ``synthetic.draw_torchvision_weights('resnet50', seed)`` with
``load_state_dict(strict=True)`` (the BatchNorm counters copied from the model, as
they carry no weights), and stores, in eval mode and float32 on seeded 224x224 images
(batch 2), the logits (``model(x)``) and the pooled features
(``model.forward_head(model.forward_features(x), pre_logits=True)``, the 2048-vector
DomainBed's featurizer returns) in ``tests/models/golden_timm_resnet.npz``, with the
weights' fingerprint. The test then needs no torch.

Run it by hand, with torch and timm installed next to sagm_jax's own dependencies
(``pip install 'sagm_jax[torch]' torchvision timm open_clip_torch transformers``):

    python experiments/make_timm_resnet_golden.py [--out tests/models/golden_timm_resnet.npz]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import timm
import torch

from sagm_jax.models.synthetic import draw_images, draw_torchvision_weights, weights_fingerprint
from sagm_jax.models.torchvision_weights import torchvision_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Stored in the golden file, from which the test reads them.
TIMM_MODEL = "resnet50.ram_in1k"
WEIGHT_SEED = 5050
IMAGE_SEED = 2224
SIZE = 224
BATCH = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(REPO, "tests", "models", "golden_timm_resnet.npz")
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, timm {timm.__version__}")
    torch.use_deterministic_algorithms(True)
    model = timm.create_model(TIMM_MODEL, pretrained=False).eval()
    state = model.state_dict()
    reference = [
        (key, tuple(value.shape))
        for key, value in state.items()
        if not key.endswith(".num_batches_tracked")
    ]
    ours = [(entry.torch_key, entry.shape) for entry in torchvision_layout("resnet50")]
    if reference != ours:
        raise SystemExit(f"timm {TIMM_MODEL}: keys/order/shapes differ from torchvision_layout")
    weights = draw_torchvision_weights("resnet50", WEIGHT_SEED)
    tensors = {key: torch.from_numpy(value) for key, value in weights.items()}
    counters = {key: value for key, value in state.items() if key.endswith(".num_batches_tracked")}
    model.load_state_dict({**tensors, **counters}, strict=True)
    images = torch.from_numpy(draw_images(IMAGE_SEED, BATCH, SIZE))
    with torch.no_grad():
        logits = model(images).numpy()
        features = model.forward_head(model.forward_features(images), pre_logits=True).numpy()
    golden = {
        "fingerprint": np.array(weights_fingerprint(weights)),
        "weight_seed": np.array(WEIGHT_SEED),
        "image_seed": np.array(IMAGE_SEED),
        "logits": logits.astype(np.float32),
        "features": features.astype(np.float32),
        "torch_version": np.array(torch.__version__),
        "timm_version": np.array(timm.__version__),
        "timm_model": np.array(TIMM_MODEL),
    }
    print(
        f"logits {logits.shape} std {logits.std():.3f}; features {features.shape} "
        f"std {features.std():.3f}"
    )
    np.savez_compressed(args.out, **golden)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
