"""Write torchvision's own RegNetY outputs on seeded weights and images to a golden file.

MIRO's strongest backbone is SWAG's RegNetY-16GF (``khanrc/miro``,
``domainbed/networks/backbones.py``, ``swag_regnety_16gf``: the torch.hub SWAG trunk
with its head replaced by ``AdaptiveAvgPool2d(1)`` + ``Flatten``); torchvision's
``regnet_y_16gf`` is the same network (torchvision ships the SWAG weights for it).
This script shows that torchvision's network computes what ``sagm_jax.models.regnet``
does, and stores in ``tests/models/golden_regnet.npz``:

* the stage parameters of ``torchvision.models.regnet.BlockParams.from_init_params``
  for every RegNet torchvision defines (its ``regnet_y_*`` / ``regnet_x_*`` builders
  called with ``_regnet`` replaced by a function that returns the parameters, so no
  network is built), for ``regnet.regnet_block_params`` to be checked against;
* RegNetY-16GF (``torchvision.models.regnet_y_16gf()``; its ``state_dict()`` keys,
  order and shapes checked to be exactly ``regnet_weights.regnet_layout()``'s), with
  the weights of ``synthetic.draw_regnet_weights`` loaded by
  ``load_state_dict(strict=True)`` (the BatchNorm counters copied from the model:
  they carry no weights), in eval mode and float32 on seeded 224x224 images (batch 2):
  the logits ``model(x)``, the 3024-d feature ``avgpool(trunk_output(stem(x)))``
  flattened (MIRO's featurizer output), and of the outputs of ``stem`` and
  ``trunk_output.block1`` .. ``block4`` (forward hooks: the modules MIRO's
  ``ur_networks.BLOCKNAMES["regnety"]`` names) the per-channel spatial means [B, C]
  and a corner slice ``[:, :3, :3, :8]`` (NHWC), with their shapes;
* a reduced RegNetY (``torchvision.models.regnet.RegNet`` on ``BlockParams`` of
  ``synthetic.REGNET_SMALL_PARAMS``, stem width 8, 5 classes) at 36x36: eval logits,
  train-mode logits (batch statistics), and the running statistics of the stem's BN
  and of the last block's last BN after that one train-mode call.

Run it by hand, with torch and torchvision installed next to sagm_jax's own
dependencies (``pip install 'sagm_jax[torch]' torchvision timm open_clip_torch
transformers``):

    python experiments/make_regnet_golden.py [--out tests/models/golden_regnet.npz]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from functools import partial

import numpy as np
import torch
import torchvision.models.regnet as tv_regnet

from sagm_jax.models.regnet import BlockParams
from sagm_jax.models.regnet_weights import regnet_layout
from sagm_jax.models.synthetic import (
    REGNET_GOLDEN_BATCH,
    REGNET_GOLDEN_IMAGE_SEED,
    REGNET_GOLDEN_SIZE,
    REGNET_GOLDEN_WEIGHT_SEED,
    REGNET_SMALL_CLASSES,
    REGNET_SMALL_IMAGE_SEED,
    REGNET_SMALL_PARAMS,
    REGNET_SMALL_SIZE,
    REGNET_SMALL_STEM,
    REGNET_SMALL_WEIGHT_SEED,
    draw_images,
    draw_regnet_weights,
    weights_fingerprint,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("stem", "block1", "block2", "block3", "block4")
# The BatchNorms whose running statistics the train-mode call's update is stored of.
SMALL_BATCHNORMS = ("stem.1", "trunk_output.block4.block4-0.f.c.1")


def torchvision_block_params() -> dict[str, np.ndarray]:
    """Each torchvision RegNet builder's settings and ``from_init_params`` result."""
    calls = {}
    original_init = tv_regnet.BlockParams.from_init_params.__func__
    original_regnet = tv_regnet._regnet

    def record(
        cls, depth, w_0, w_a, w_m, group_width, bottleneck_multiplier=1.0, se_ratio=None, **kw
    ):
        result = original_init(
            cls, depth, w_0, w_a, w_m, group_width, bottleneck_multiplier, se_ratio, **kw
        )
        calls["last"] = ((depth, w_0, w_a, w_m, group_width, bottleneck_multiplier), result)
        return result

    tv_regnet.BlockParams.from_init_params = classmethod(record)
    tv_regnet._regnet = lambda params, weights, progress, **kwargs: params
    out = {}
    try:
        names = [n for n in tv_regnet.__all__ if n.startswith(("regnet_y_", "regnet_x_"))]
        for name in names:
            getattr(tv_regnet, name)()
            settings, params = calls.pop("last")
            out[f"params_{name}_settings"] = np.array(settings, dtype=np.float64)
            out[f"params_{name}_depths"] = np.array(params.depths)
            out[f"params_{name}_widths"] = np.array(params.widths)
            out[f"params_{name}_group_widths"] = np.array(params.group_widths)
            out[f"params_{name}_multipliers"] = np.array(params.bottleneck_multipliers)
    finally:
        tv_regnet.BlockParams.from_init_params = classmethod(original_init)
        tv_regnet._regnet = original_regnet
    out["params_names"] = np.array(names)
    return out


def load_strict(model: torch.nn.Module, weights: dict[str, np.ndarray], layout) -> None:
    """Check the model's keys/order/shapes against ``layout``, then load strictly."""
    state = model.state_dict()
    reference = [
        (k, tuple(v.shape)) for k, v in state.items() if not k.endswith(".num_batches_tracked")
    ]
    ours = [(entry.torch_key, entry.shape) for entry in layout]
    if reference != ours:
        raise SystemExit("regnet_layout differs from torchvision's state_dict order/shapes")
    loaded = {key: torch.from_numpy(value) for key, value in weights.items()}
    loaded.update({k: v for k, v in state.items() if k.endswith(".num_batches_tracked")})
    model.load_state_dict(loaded, strict=True)


def full_network() -> dict[str, np.ndarray]:
    """RegNetY-16GF's outputs and intermediate features in eval mode."""
    model = tv_regnet.regnet_y_16gf().eval()
    weights = draw_regnet_weights(REGNET_GOLDEN_WEIGHT_SEED)
    load_strict(model, weights, regnet_layout(1000))
    captured = {}
    modules = {"stem": model.stem, **{f"block{i}": model.trunk_output[i - 1] for i in range(1, 5)}}
    for name, module in modules.items():
        module.register_forward_hook(lambda m, i, o, name=name: captured.__setitem__(name, o))
    images = torch.from_numpy(
        draw_images(REGNET_GOLDEN_IMAGE_SEED, REGNET_GOLDEN_BATCH, REGNET_GOLDEN_SIZE)
    )
    with torch.no_grad():
        logits = model(images)
        feature = model.avgpool(captured["block4"]).flatten(1)
    out = {
        "fingerprint": np.array(weights_fingerprint(weights)),
        "logits": logits.numpy(),
        "feature": feature.numpy(),
    }
    for name in STAGES:
        nhwc = captured[name].permute(0, 2, 3, 1).numpy()
        out[f"{name}_shape"] = np.array(nhwc.shape)
        out[f"{name}_mean"] = nhwc.mean(axis=(1, 2), dtype=np.float64).astype(np.float32)
        out[f"{name}_corner"] = nhwc[:, :3, :3, :8]
    print(
        f"regnet_y_16gf {REGNET_GOLDEN_SIZE}x{REGNET_GOLDEN_SIZE}: logits std {logits.std():.3f}, "
        f"feature std {feature.std():.3f}, max |feature| {feature.abs().max():.3f}"
    )
    return out


def small_network() -> dict[str, np.ndarray]:
    """The reduced RegNetY's eval and train-mode outputs and running-statistic updates."""
    depths, widths, group_widths, multipliers = REGNET_SMALL_PARAMS
    params = tv_regnet.BlockParams(
        list(depths), list(widths), list(group_widths), list(multipliers), [2] * 4, se_ratio=0.25
    )
    norm = partial(torch.nn.BatchNorm2d, eps=1e-5, momentum=0.1)
    model = tv_regnet.RegNet(
        params, num_classes=REGNET_SMALL_CLASSES, stem_width=REGNET_SMALL_STEM, norm_layer=norm
    )
    weights = draw_regnet_weights(
        REGNET_SMALL_WEIGHT_SEED, REGNET_SMALL_CLASSES, REGNET_SMALL_PARAMS, REGNET_SMALL_STEM
    )
    layout = regnet_layout(
        REGNET_SMALL_CLASSES, BlockParams(*REGNET_SMALL_PARAMS), stem_width=REGNET_SMALL_STEM
    )
    load_strict(model, weights, layout)
    images = torch.from_numpy(draw_images(REGNET_SMALL_IMAGE_SEED, 4, REGNET_SMALL_SIZE))
    out = {"small_fingerprint": np.array(weights_fingerprint(weights))}
    with torch.no_grad():
        out["small_eval_logits"] = model.eval()(images).numpy()
        out["small_train_logits"] = model.train()(images).numpy()
    state = model.state_dict()
    for name in SMALL_BATCHNORMS:
        for stat in ("running_mean", "running_var"):
            out[f"small_{name}.{stat}"] = state[f"{name}.{stat}"].numpy()
    print(
        f"small RegNetY {REGNET_SMALL_SIZE}x{REGNET_SMALL_SIZE}: eval logits {out['small_eval_logits'].std():.3f}"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "models", "golden_regnet.npz"))
    args = parser.parse_args()
    version = importlib.metadata.version("torchvision")
    print(f"torch {torch.__version__}, torchvision {version}")
    torch.use_deterministic_algorithms(True)
    golden = {**torchvision_block_params(), **full_network(), **small_network()}
    golden["torch_version"] = np.array(torch.__version__)
    golden["torchvision_version"] = np.array(version)
    np.savez_compressed(args.out, **golden)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
