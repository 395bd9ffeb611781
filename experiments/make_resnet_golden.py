"""Write torchvision's ResNet logits on seeded weights and images to a golden file.

Run by hand, with torch and torchvision installed next to sagm_jax's own
dependencies (``pip install 'sagm_jax[torch]' torchvision``):

    python experiments/make_resnet_golden.py [--out tests/models/golden_resnet.npz]

For resnet18 and resnet50 it draws the weights and images defined once in
``sagm_jax.models.synthetic`` (shared with the parity test), loads the weights into
torchvision's own ``resnet18()``/``resnet50()`` (``load_state_dict``, checked to leave out only the counters,
after checking that torchvision's keys, order and shapes are exactly
``torchvision_layout``'s), and stores its eval-mode float32 logits for each image
size in ``GOLDEN_SIZES``. The test then needs no torch.

torchvision wheels built for CUDA fail to load their compiled ops on a CPU-only
torch (``operator torchvision::nms does not exist`` at import). The ResNet code is
pure Python, so in that case this script imports ``torchvision.models.resnet``
without running the package ``__init__`` that loads those ops; the network code
executed is still torchvision's own, unchanged.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import types

import numpy as np
import torch

from sagm_jax.models.synthetic import (
    GOLDEN_ARCHS,
    GOLDEN_BATCH,
    GOLDEN_IMAGE_SEED,
    GOLDEN_SIZES,
    GOLDEN_WEIGHT_SEEDS,
    draw_images,
    draw_torchvision_weights,
    weights_fingerprint,
)
from sagm_jax.models.torchvision_weights import torchvision_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_torchvision_resnet():
    """torchvision.models.resnet, bypassing the compiled-ops import when it fails."""
    try:
        import torchvision.models.resnet as resnet

        return resnet, "torchvision (normal import)"
    except (RuntimeError, ImportError, OSError) as error:
        reason = f"{type(error).__name__}: {error}"
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    package_dir = os.path.dirname(importlib.util.find_spec("torchvision").origin)
    for name, sub in (("torchvision", ""), ("torchvision.models", "models")):
        stub = types.ModuleType(name)
        stub.__path__ = [os.path.join(package_dir, sub)]
        sys.modules[name] = stub
    import torchvision.models.resnet as resnet

    return resnet, f"torchvision.models.resnet imported directly ({reason})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "models", "golden_resnet.npz"))
    args = parser.parse_args()
    resnet, how = import_torchvision_resnet()
    torchvision_version = importlib.metadata.version("torchvision")
    print(f"torch {torch.__version__}, torchvision {torchvision_version}, {how}")
    torch.use_deterministic_algorithms(True)
    golden = {}
    for arch in GOLDEN_ARCHS:
        model = getattr(resnet, arch)().eval()
        reference = [
            (key, tuple(value.shape))
            for key, value in model.state_dict().items()
            if not key.endswith(".num_batches_tracked")
        ]
        ours = [(entry.torch_key, entry.shape) for entry in torchvision_layout(arch)]
        if reference != ours:
            raise SystemExit(
                f"{arch}: torchvision_layout differs from torchvision's state_dict order/shapes"
            )
        weights = draw_torchvision_weights(arch, GOLDEN_WEIGHT_SEEDS[arch])
        # strict=False only because the counters (num_batches_tracked) are not drawn.
        result = model.load_state_dict(
            {key: torch.from_numpy(value) for key, value in weights.items()}, strict=False
        )
        if result.unexpected_keys or not all(
            k.endswith(".num_batches_tracked") for k in result.missing_keys
        ):
            raise SystemExit(f"{arch}: load_state_dict mismatch {result}")
        golden[f"{arch}_fingerprint"] = np.array(weights_fingerprint(weights))
        for size in GOLDEN_SIZES:
            images = draw_images(GOLDEN_IMAGE_SEED + size, GOLDEN_BATCH, size)
            with torch.no_grad():
                logits = model(torch.from_numpy(images)).numpy()
            golden[f"{arch}_{size}"] = logits.astype(np.float32)
            print(
                f"{arch} {size}x{size}: logits std {logits.std():.3f}, max |.| {np.abs(logits).max():.3f}"
            )
    golden["torch_version"] = np.array(torch.__version__)
    golden["torchvision_version"] = np.array(torchvision_version)
    np.savez_compressed(args.out, **golden)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
