"""Write the reference CLIP ViT-B/16 and DINOv2 ViT-B/14 outputs on seeded weights to a golden file.

Run by hand, with the reference libraries installed next to sagm_jax's own dependencies
(``pip install 'sagm_jax[torch]' torchvision timm open_clip_torch transformers``):

    python experiments/make_vit_golden.py [--out tests/models/golden_vit.npz]

The weights and images are drawn by ``sagm_jax.models.synthetic`` (shared with
tests/models/test_vit.py); the file stores only the reference outputs and a fingerprint
of the drawn weights, so the test needs no torch.

CLIP ViT-B/16: open_clip's own ``VisionTransformer``
(``open_clip.create_model('ViT-B-16', pretrained=None, quick_gelu=True).visual``), its
``state_dict()`` keys, order and shapes checked to be ``vit_weights.clip_vit_layout``'s,
the weights loaded with ``load_state_dict(strict=True)``, run in eval mode in float32:
the 512-d feature (the tower's output), and forward hooks on ``conv1`` (NCHW, stored
NHWC) and ``transformer.resblocks.2/5/8/11`` (batch first in open_clip) for MIRO's
intermediates.

DINOv2 ViT-B/14: facebookresearch/dinov2's code cannot be installed here (torch.hub
fetches it from GitHub), so the reference is ``transformers.Dinov2Model``, an
independent port of the same network (``Dinov2Config``: hidden 768, 12 layers, 12
heads, patch 14, ``layerscale_value`` 1.0, ``use_swiglu_ffn`` False,
``layer_norm_eps`` 1e-6, ``qkv_bias`` True, exact GELU; eager attention), loaded through
the key mapping ``hf_state_dict`` below (the hub's fused ``attn.qkv`` split into
``q_proj``/``k_proj``/``v_proj``) with ``load_state_dict(strict=True)``. transformers'
``Dinov2Embeddings.interpolate_pos_encoding`` resamples the position table with
``size=(g, g)``; DINOv2's own ``interpolate_pos_encoding`` passes
``scale_factor=(g + 0.1) / 37`` (``interpolate_offset`` 0.1, ``interpolate_antialias``
False for the hub models), and torch then samples the source at (i + 0.5) / scale - 0.5
rather than (i + 0.5) * 37 / g - 0.5: a different table. So this script resamples the
hub-layout ``pos_embed`` here with torch's ``F.interpolate`` exactly as DINOv2's code
(``dinov2_resample``), builds the transformers model at ``image_size`` 224 (a 16 x 16
grid, so transformers uses the table as it is) and loads the resampled table; the
script prints how far transformers' own resampling would be. DomainBed HEAD's feature
(``domainbed/networks.py`` ``DinoV2``: ``get_intermediate_layers(x, n=4,
return_class_token=True)``, normalised by the final ``norm``) is computed from
``output_hidden_states``: the last four blocks' outputs through the model's final
``layernorm``, their class tokens and the mean patch token of the last. Hooks on the
patch embedding and on ``encoder.layer.2/5/8/11`` give MIRO's intermediates.

Also stored: the names of the reference parameters that contain ``attn`` (DomainBed's
``vit_attn_tune`` rule) — open_clip's ``named_parameters`` for CLIP, and for DINOv2 the
hub names of the transformers parameters through the same mapping (transformers calls
the module ``attention``) — and torch's ``F.interpolate`` resampling of a small
seeded table to the grids ``VIT_POS_GRIDS``, exactly as DINOv2's code calls it.
Intermediate features are stored as their mean over the tokens (pixels) [B, D] and
each token's L2 norm [B, L], to keep the file small.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from sagm_jax.models.synthetic import (
    VIT_BATCH,
    VIT_IMAGE_SEED,
    VIT_POS_GRIDS,
    VIT_POS_SEED,
    VIT_POS_WIDTH,
    VIT_SIZE,
    VIT_WEIGHT_SEEDS,
    draw_clip_vit_weights,
    draw_dinov2_weights,
    draw_images,
    draw_pos_table,
    weights_fingerprint,
)
from sagm_jax.models.vit import miro_blocks
from sagm_jax.models.vit_weights import (
    clip_vit_layout,
    convert_clip_vit,
    detect_clip_vit,
    detect_dinov2,
    dinov2_layout,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIRO_BLOCKS = miro_blocks(12)


def summarise(golden: dict, prefix: str, name: str, array: np.ndarray) -> None:
    """Mean over tokens (pixels) and per-token norms of a [B, L, D] or [B, H, W, D] array."""
    tokens = array.reshape(array.shape[0], -1, array.shape[-1]).astype(np.float64)
    golden[f"{prefix}_{name}_mean"] = tokens.mean(axis=1).astype(np.float32)
    golden[f"{prefix}_{name}_norms"] = np.linalg.norm(tokens, axis=-1).astype(np.float32)
    golden[f"{prefix}_{name}_shape"] = np.array(array.shape)


def record(store: dict, name: str, transform=lambda t: t):
    def hook(module, inputs, output):
        store[name] = transform(output.detach()).numpy()

    return hook


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{name}/"))
        else:
            flat[prefix + name] = value
    return flat


def check_whole_model(whole) -> None:
    """A whole CLIP model's state dict (OpenAI's checkpoints hold one: ``visual.*`` and the
    text tower's keys, which share names such as ``transformer.resblocks.0.*``) converts as
    its image tower alone, and both are detected as CLIP ViT, neither as DINOv2."""
    full = {key: value.numpy() for key, value in whole.state_dict().items()}
    visual = {key: value.numpy() for key, value in whole.visual.state_dict().items()}
    if not (detect_clip_vit(full) and detect_clip_vit(visual)) or detect_dinov2(full):
        raise SystemExit("detect_clip_vit/detect_dinov2 misjudge open_clip's state dicts")
    ours, theirs = flatten(convert_clip_vit(full)), flatten(convert_clip_vit(visual))
    if ours.keys() != theirs.keys() or any(
        not np.array_equal(ours[key], theirs[key]) for key in ours
    ):
        raise SystemExit("a whole CLIP model's state dict converts differently from its tower's")
    print(f"whole CLIP model: {len(full)} keys, {len(visual)} of the image tower; converts as it")


def clip_golden(golden: dict, images: np.ndarray) -> None:
    import open_clip

    whole = open_clip.create_model("ViT-B-16", pretrained=None, quick_gelu=True).eval()
    check_whole_model(whole)
    visual = whole.visual
    reference = [(key, tuple(value.shape)) for key, value in visual.state_dict().items()]
    ours = [(entry.torch_key, entry.shape) for entry in clip_vit_layout()]
    if reference != ours:
        raise SystemExit("clip_vit_layout differs from open_clip's state_dict order/shapes")
    weights = draw_clip_vit_weights(VIT_WEIGHT_SEEDS["clip_vit_b16"])
    visual.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    if not visual.transformer.batch_first:
        raise SystemExit("open_clip's transformer is not batch first: transpose the hooks")
    hooked = {}
    visual.conv1.register_forward_hook(record(hooked, "stem", lambda t: t.permute(0, 2, 3, 1)))
    for group, block in enumerate(MIRO_BLOCKS, start=1):
        visual.transformer.resblocks[block].register_forward_hook(record(hooked, f"block{group}"))
    with torch.no_grad():
        feature = visual(torch.from_numpy(images)).numpy()
    golden["clip_fingerprint"] = np.array(weights_fingerprint(weights))
    golden["clip_feature"] = feature.astype(np.float32)
    for name, array in hooked.items():
        summarise(golden, "clip", name, array)
    golden["clip_attn_names"] = np.array(
        [name for name, _ in visual.named_parameters() if "attn" in name]
    )
    print(f"CLIP: feature {feature.shape} std {feature.std():.3f}, "
          + ", ".join(f"{k} {v.shape} std {v.std():.2f}" for k, v in hooked.items()))


def dinov2_resample(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """DINOv2's ``interpolate_pos_encoding`` for a grid x grid input (hub settings:
    offset 0.1, no antialias), on a [1, 1 + M^2, D] table."""
    n = pos_embed.shape[1] - 1
    m = int(math.sqrt(n))
    if grid == m:
        return pos_embed
    scale = float(grid + 0.1) / m
    patches = F.interpolate(
        pos_embed[:, 1:].float().reshape(1, m, m, -1).permute(0, 3, 1, 2),
        scale_factor=(scale, scale), mode="bicubic", antialias=False,
    )
    assert patches.shape[-2:] == (grid, grid), patches.shape
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)
    return torch.cat([pos_embed[:, :1], patches], dim=1)


def hf_state_dict(hub: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """The hub checkpoint's keys as transformers' ``Dinov2Model`` names them."""
    out = {}
    names = {"cls_token": "embeddings.cls_token", "pos_embed": "embeddings.position_embeddings",
             "mask_token": "embeddings.mask_token", "norm.weight": "layernorm.weight",
             "norm.bias": "layernorm.bias",
             "patch_embed.proj.weight": "embeddings.patch_embeddings.projection.weight",
             "patch_embed.proj.bias": "embeddings.patch_embeddings.projection.bias"}
    inner = {"norm1": "norm1", "norm2": "norm2", "attn.proj": "attention.o_proj",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for key, value in hub.items():
        if key in names:
            out[names[key]] = value
            continue
        _, index, rest = key.split(".", 2)
        prefix = f"encoder.layer.{index}."
        module, leaf = rest.rsplit(".", 1)
        if module.startswith("ls"):
            out[prefix + f"layer_scale{module[2]}.lambda1"] = value
        elif module == "attn.qkv":
            for part, chunk in zip("qkv", value.split(width, dim=0)):
                out[prefix + f"attention.{part}_proj.{leaf}"] = chunk.clone()
        else:
            out[prefix + f"{inner[module]}.{leaf}"] = value
    return out


def hub_name(hf_name: str) -> str:
    """transformers' parameter name as the hub checkpoint names it (the inverse mapping,
    with q/k/v folded back into ``attn.qkv``)."""
    if hf_name.startswith("encoder.layer."):
        _, _, index, rest = hf_name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        module = {"attention.q_proj": "attn.qkv", "attention.k_proj": "attn.qkv",
                  "attention.v_proj": "attn.qkv", "attention.o_proj": "attn.proj",
                  "layer_scale1": "ls1", "layer_scale2": "ls2"}.get(module, module)
        leaf = "gamma" if leaf == "lambda1" else leaf
        return f"blocks.{index}.{module}.{leaf}"
    return {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
            "embeddings.mask_token": "mask_token", "layernorm.weight": "norm.weight",
            "layernorm.bias": "norm.bias",
            "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
            "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias"}[hf_name]


def dinov2_model(image_size: int):
    import transformers

    config = transformers.Dinov2Config(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, mlp_ratio=4,
        hidden_act="gelu", layer_norm_eps=1e-6, image_size=image_size, patch_size=14,
        qkv_bias=True, layerscale_value=1.0, use_swiglu_ffn=False, drop_path_rate=0.0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.Dinov2Model(config)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    return model.eval()


def dinov2_feature(model, pixels: torch.Tensor):
    """DomainBed's feature and MIRO's intermediates from ``model``."""
    hooked = {}
    handles = [model.embeddings.patch_embeddings.register_forward_hook(
        record(hooked, "stem", lambda t: t.reshape(t.shape[0], 16, 16, -1)))]
    for group, block in enumerate(MIRO_BLOCKS, start=1):
        layer = model.encoder.layer[block]
        handles.append(layer.register_forward_hook(record(hooked, f"block{group}")))
    with torch.no_grad():
        outputs = model(pixel_values=pixels, output_hidden_states=True)
        states = outputs.hidden_states
        assert len(states) == 13, len(states)  # the embeddings, then each block's output
        for group, block in enumerate(MIRO_BLOCKS, start=1):
            assert np.array_equal(states[block + 1].numpy(), hooked[f"block{group}"])
        normed = [model.layernorm(state) for state in states[-4:]]
        assert torch.equal(normed[-1], outputs.last_hidden_state)
        feature = torch.cat([out[:, 0] for out in normed] + [normed[-1][:, 1:].mean(1)], dim=1)
    for handle in handles:
        handle.remove()
    return feature.numpy(), hooked


def dinov2_golden(golden: dict, images: np.ndarray) -> None:
    drawn = draw_dinov2_weights(VIT_WEIGHT_SEEDS["dinov2_vit_b14"])
    hub = {key: torch.from_numpy(value) for key, value in drawn.items()}
    grid = VIT_SIZE // 14
    resampled = dict(hub, pos_embed=dinov2_resample(hub["pos_embed"], grid))
    model = dinov2_model(VIT_SIZE)
    model.load_state_dict(hf_state_dict(resampled, 768), strict=True)
    feature, hooked = dinov2_feature(model, torch.from_numpy(images))
    golden["dinov2_fingerprint"] = np.array(weights_fingerprint(drawn))
    golden["dinov2_feature"] = feature.astype(np.float32)
    for name, array in hooked.items():
        summarise(golden, "dinov2", name, array)
    names = [hub_name(name) for name, _ in model.named_parameters()]
    assert set(names) == {entry.torch_key for entry in dinov2_layout()}
    golden["dinov2_attn_names"] = np.array(sorted({n for n in names if "attn" in n}))
    # transformers' own resampling (size=(16, 16)) at image_size 518, for the record.
    own = dinov2_model(518)
    own.load_state_dict(hf_state_dict(hub, 768), strict=True)
    own_feature, _ = dinov2_feature(own, torch.from_numpy(images))
    difference = np.abs(own_feature - feature).max() / np.abs(feature).max()
    print(f"DINOv2: feature {feature.shape} std {feature.std():.3f}; transformers' own "
          f"resampling would differ by {difference:.2e} relative")


def resampling_golden(golden: dict) -> None:
    table = draw_pos_table(VIT_POS_SEED, 37, VIT_POS_WIDTH)
    for grid in VIT_POS_GRIDS:
        golden[f"pos_resampled_{grid}"] = dinov2_resample(torch.from_numpy(table), grid).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "models", "golden_vit.npz"))
    args = parser.parse_args()
    versions = {name: importlib.metadata.version(name)
                for name in ("torch", "open_clip_torch", "transformers")}
    print(versions)
    torch.use_deterministic_algorithms(True)
    images = draw_images(VIT_IMAGE_SEED, VIT_BATCH, VIT_SIZE)
    golden: dict[str, np.ndarray] = {}
    clip_golden(golden, images)
    dinov2_golden(golden, images)
    resampling_golden(golden)
    for name, version in versions.items():
        golden[f"{name}_version"] = np.array(version)
    np.savez_compressed(args.out, **golden)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
