"""Write open_clip's CLIP ResNet-50 image-tower outputs on seeded weights to a golden file.

Run by hand, with the reference libraries installed next to sagm_jax's own dependencies
(``pip install 'sagm_jax[torch]' torchvision timm open_clip_torch transformers``):

    python experiments/make_clip_resnet_golden.py [--out tests/models/golden_clip_resnet.npz]

The reference is open_clip's own code: ``open_clip.create_model('RN50', pretrained=None,
quick_gelu=True).visual`` (class ``open_clip.modified_resnet.ModifiedResNet``, OpenAI's
``RN50`` image tower) and, for the reduced variant, ``ModifiedResNet(layers=(1, 1, 1, 1),
output_dim=32, heads=4, image_size=64, width=8)``. For each, the script checks that
``clip_resnet_layout`` lists exactly the reference's ``state_dict()`` keys (counters
aside) in its order with its shapes, draws the weights of
``sagm_jax.models.synthetic.draw_clip_resnet_weights`` (shared with the test), loads them
with ``load_state_dict(strict=True)`` (the reference's own zero counters added), and runs
float32 forwards on ``draw_images``:

* RN50, eval mode, 224x224, batch 2: the attention-pool feature [2, 1024] (MIRO's
  featurizer output) and, from forward hooks on ``avgpool`` and ``layer1``..``layer4``
  (MIRO's ``BLOCKNAMES["clipresnet"]``), each map's per-channel spatial mean [2, C], its
  per-example L2 norm [2] and a corner slice ``[:, :4, :4, :16]``, all NHWC;
* the reduced variant at 64x64, batch 2: the eval-mode feature, the train-mode feature
  (batch statistics) and the running statistics of ``bn1`` and ``layer4.0.bn3`` after
  that one train-mode forward (torch's momentum 0.1, unbiased variance);
* the reduced variant at ``CLIP_RESNET_ODD_SIZE`` (100x100: maps of odd size, whose
  average pools drop a row and a column), eval mode: the feature.

The test then needs no torch.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os

import numpy as np
import open_clip
import torch
from open_clip.modified_resnet import ModifiedResNet

from sagm_jax.models.clip_resnet_weights import clip_resnet_layout
from sagm_jax.models.synthetic import (
    CLIP_RESNET_IMAGE_SEED,
    CLIP_RESNET_ODD_SIZE,
    CLIP_RESNET_SIZE,
    CLIP_RESNET_SMALL,
    CLIP_RESNET_SMALL_SEED,
    CLIP_RESNET_SMALL_SIZE,
    CLIP_RESNET_WEIGHT_SEED,
    GOLDEN_BATCH,
    draw_clip_resnet_weights,
    draw_images,
    weights_fingerprint,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKED = {
    "stem": "avgpool",
    "block1": "layer1",
    "block2": "layer2",
    "block3": "layer3",
    "block4": "layer4",
}
SMALL_BNS = ("bn1", "layer4.0.bn3")
COUNTER = ".num_batches_tracked"


def load(model: torch.nn.Module, weights: dict, layout_args: dict, label: str) -> None:
    """Check our layout against the reference's state dict, then load strictly."""
    own = model.state_dict()
    reference = [(k, tuple(v.shape)) for k, v in own.items() if not k.endswith(COUNTER)]
    ours = [(e.torch_key, e.shape) for e in clip_resnet_layout(**layout_args)]
    if reference != ours:
        raise SystemExit(f"{label}: clip_resnet_layout differs from the reference's state_dict")
    state = {key: torch.from_numpy(value) for key, value in weights.items()}
    state.update({k: v.clone() for k, v in own.items() if k.endswith(COUNTER)})
    model.load_state_dict(state, strict=True)


def rn50_outputs(golden: dict) -> None:
    model = open_clip.create_model("RN50", pretrained=None, quick_gelu=True).visual
    model = model.float().eval()
    assert isinstance(model, ModifiedResNet), type(model)
    weights = draw_clip_resnet_weights(CLIP_RESNET_WEIGHT_SEED, CLIP_RESNET_SIZE)
    load(model, weights, {"image_size": CLIP_RESNET_SIZE}, "RN50")
    maps = {}
    for name, module in HOOKED.items():
        getattr(model, module).register_forward_hook(
            lambda _m, _i, out, name=name: maps.__setitem__(name, out.permute(0, 2, 3, 1).numpy())
        )
    images = draw_images(CLIP_RESNET_IMAGE_SEED, GOLDEN_BATCH, CLIP_RESNET_SIZE)
    with torch.no_grad():
        feature = model(torch.from_numpy(images)).numpy()
    golden["rn50_fingerprint"] = np.array(weights_fingerprint(weights))
    golden["rn50_feature"] = feature.astype(np.float32)
    print(
        f"RN50 feature {feature.shape}: std {feature.std():.3f}, max |.| {np.abs(feature).max():.3f}"
    )
    for name, array in maps.items():
        golden[f"rn50_{name}_mean"] = array.mean(axis=(1, 2)).astype(np.float32)
        golden[f"rn50_{name}_norm"] = np.sqrt(
            (array.astype(np.float64) ** 2).sum(axis=(1, 2, 3))
        ).astype(np.float32)
        golden[f"rn50_{name}_slice"] = np.ascontiguousarray(array[:, :4, :4, :16])
        print(f"  {name} {array.shape}: mean {array.mean():.3f}, std {array.std():.3f}")


def small_outputs(golden: dict) -> None:
    size = CLIP_RESNET_SMALL_SIZE
    model = ModifiedResNet(image_size=size, **CLIP_RESNET_SMALL).float()
    layout_args = {
        "image_size": size,
        **{k: v for k, v in CLIP_RESNET_SMALL.items() if k != "heads"},
    }
    weights = draw_clip_resnet_weights(CLIP_RESNET_SMALL_SEED, **layout_args)
    load(model, weights, layout_args, "reduced variant")
    images = torch.from_numpy(draw_images(CLIP_RESNET_IMAGE_SEED + size, GOLDEN_BATCH, size))
    with torch.no_grad():
        golden["small_eval_feature"] = model.eval()(images).numpy()
        golden["small_train_feature"] = model.train()(images).numpy()
    state = model.state_dict()
    for bn in SMALL_BNS:
        golden[f"small_{bn}_running_mean"] = state[f"{bn}.running_mean"].numpy()
        golden[f"small_{bn}_running_var"] = state[f"{bn}.running_var"].numpy()
    golden["small_fingerprint"] = np.array(weights_fingerprint(weights))
    print(
        f"reduced variant {size}x{size}: eval feature std {golden['small_eval_feature'].std():.3f}"
    )
    size = CLIP_RESNET_ODD_SIZE
    model = ModifiedResNet(image_size=size, **CLIP_RESNET_SMALL).float().eval()
    layout_args["image_size"] = size
    weights = draw_clip_resnet_weights(CLIP_RESNET_SMALL_SEED, **layout_args)
    load(model, weights, layout_args, f"reduced variant at {size}")
    images = torch.from_numpy(draw_images(CLIP_RESNET_IMAGE_SEED + size, GOLDEN_BATCH, size))
    with torch.no_grad():
        golden["odd_feature"] = model(images).numpy()
    golden["odd_fingerprint"] = np.array(weights_fingerprint(weights))
    print(f"reduced variant {size}x{size}: feature std {golden['odd_feature'].std():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(REPO, "tests", "models", "golden_clip_resnet.npz")
    )
    args = parser.parse_args()
    version = importlib.metadata.version("open_clip_torch")
    print(f"torch {torch.__version__}, open_clip {version}")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    golden: dict = {}
    rn50_outputs(golden)
    small_outputs(golden)
    golden["torch_version"] = np.array(torch.__version__)
    golden["open_clip_version"] = np.array(version)
    np.savez_compressed(args.out, **golden)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
