"""Flax Vision Transformers: CLIP ViT-B/16's image tower and DINOv2 ViT-B/14.

This module owns the two ViT networks and the pre-norm Transformer encoder they share;
their weights (layouts, conversion, detection, DINOv2's position resampling) live in
``vit_weights``.

The shared encoder. Image x [B, H, W, C] -> non-overlapping p x p patches, each
flattened in (row, column, channel) order and projected: the patch embedding
``conv1`` (a p x p stride-p convolution, computed as the equivalent matrix product;
torch drops the pixels past the last whole patch, and so do we) gives the grid
[B, H // p, W // p, D]. Tokens t = [class; patches] + pos, L = 1 + (H // p)(W // p)
rows. Then ``depth`` blocks ``blocks_i``, each

    t = t + g1 * Attn(LN1(t)),    t = t + g2 * MLP(LN2(t)),

with Attn(u) = concat_h softmax(q_h k_h^T / sqrt(D / heads)) v_h @ W_proj + b_proj,
[q, k, v] = u @ W_qkv + b_qkv (one fused [D, 3D] kernel, output columns ordered
(q|k|v, head, channel) as torch's fused ``in_proj_weight`` / ``qkv.weight``), and
MLP(u) = act(u @ W_fc1 + b_fc1) @ W_fc2 + b_fc2, hidden width 4D. Every attention
parameter sits under a path containing ``attn`` (``blocks_3/attn/qkv/kernel``,
``blocks_3/attn/proj/bias``) and no other parameter does, so "train only the parameters
whose path contains attn" selects exactly what DomainBed's ``vit_attn_tune``
(``'attn' in name`` over the torch network's ``named_parameters``) selects.

CLIP ViT-B/16 (open_clip ``VisionTransformer``, ``create_model('ViT-B-16',
quick_gelu=True).visual``; OpenAI's ``clip/model.py`` computes the same): p = 16,
D = 768, 12 blocks of 12 heads, no patch bias, LayerNorm eps 1e-5 everywhere,
act = QuickGELU(x) = x * sigmoid(1.702 x), no layer scale (g = 1). ``ln_pre`` on the
tokens before the blocks; the feature is ``ln_post(t[:, 0]) @ proj`` (proj [768, 512]),
MIRO's ``clip_vit-b16`` featurizer output (512). ``pos_embedding`` has
(image_size // 16)^2 + 1 rows: the checkpoints' 197 fit 224 only (open_clip does not
resample them); other sizes start from a random table.

DINOv2 ViT-B/14 (facebookresearch/dinov2 ``DinoVisionTransformer`` from
``hub/backbones.py dinov2_vitb14``: ``vit_base``, patch 14, ``init_values`` 1.0, no
registers): p = 14, D = 768, 12 blocks of 12 heads, patch bias, LayerNorm eps 1e-6,
act = exact GELU(x) = x * Phi(x), LayerScale g1 = ``ls1/gamma``, g2 = ``ls2/gamma``,
no LayerNorm before the blocks, one final LayerNorm ``norm``. The feature is DomainBed
HEAD's (``domainbed/networks.py`` class ``DinoV2``: ``get_intermediate_layers(x, n=4,
return_class_token=True)``, which normalises each output by ``norm``):
[norm(t_9)[:, 0], norm(t_10)[:, 0], norm(t_11)[:, 0], norm(t_12)[:, 0],
mean(norm(t_12)[:, 1:])], 5 x 768 = 3840 (t_i: block i's output, from 1). DINOv2 keeps
its position table at the 37 x 37 grid of 518-pixel images and resamples it for every
input; ``pos_embedding`` here is already at the model's grid (image_size // 14, 16 for
224), resampled once at conversion exactly as DINOv2 does
(``vit_weights.resample_dinov2_pos_embed``).

Both heads follow DomainBed: feature -> dropout -> fresh ``classifier``
(``resnet.linear_head``). Neither network has BatchNorm or dropout of its own (the hub's
drop-path rate is 0), so training and evaluation compute the same function apart from
the head's dropout; ``freeze_batchnorm`` is accepted and has nothing to act on.

Intermediate features (sown into :data:`INTERMEDIATES` under the names MIRO uses,
khanrc/miro ``domainbed/networks/ur_networks.py`` ``BLOCKNAMES["clipvit"]``): ``"stem"``,
the patch embedding's output as NHWC [B, H // p, W // p, D] (CLIP's ``conv1``; DINOv2's
``patch_embed``); ``"block1"`` .. ``"block4"``, the outputs of blocks 2, 5, 8, 11 (from 0:
the last of each group of three) as [B, L, D], batch first (OpenAI's CLIP runs its
blocks on [L, B, D]: the same elements). A network of other depth sows blocks
ceil(k * depth / 4) - 1 (:func:`miro_blocks`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from sagm_jax.models.resnet import INTERMEDIATES, check_images, linear_head

# CLIP's preprocessing (OpenAI clip/clip.py, open_clip OPENAI_DATASET_MEAN/STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_FEATURE_DIM = 512
CLIP_FEATURE_MAPS = False
CLIP_LAYERNORM_EPS = 1e-5
CLIP_PATCH = 16
# DINOv2's preprocessing (ImageNet's, as DomainBed normalises every dataset).
DINOV2_MEAN = (0.485, 0.456, 0.406)
DINOV2_STD = (0.229, 0.224, 0.225)
DINOV2_FEATURE_DIM = 5 * 768
DINOV2_FEATURE_MAPS = False
DINOV2_LAYERNORM_EPS = 1e-6
DINOV2_PATCH = 14
# The hub checkpoint's position grid: 518-pixel images of 14-pixel patches.
DINOV2_CHECKPOINT_GRID = 37
QUICK_GELU_FACTOR = 1.702


def miro_blocks(depth: int) -> tuple[int, int, int, int]:
    """The blocks (from 0) whose outputs are ``block1`` .. ``block4``: the last of each
    quarter of the blocks (2, 5, 8, 11 for 12 blocks, MIRO's ``clipvit`` groups)."""
    return tuple(math.ceil(k * depth / 4) - 1 for k in range(1, 5))


def quick_gelu(x):
    """CLIP's activation, x * sigmoid(1.702 x)."""
    return x * jax.nn.sigmoid(QUICK_GELU_FACTOR * x)


def exact_gelu(x):
    """torch's ``nn.GELU()``: x * Phi(x) with the error function, not the tanh form."""
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": exact_gelu}

dense_init = nn.initializers.xavier_uniform()


def layer_norm(epsilon: float, name: str) -> nn.LayerNorm:
    """torch's LayerNorm: the variance as the mean of squared deviations (not
    E[x^2] - E[x]^2, which loses digits when the mean is large)."""
    return nn.LayerNorm(epsilon=epsilon, use_fast_variance=False, name=name)


class PatchEmbed(nn.Module):
    """A ``patch_size`` x ``patch_size`` convolution of stride ``patch_size`` (kernel
    HWIO, as Flax's), computed as a product of flattened patches with the kernel."""

    width: int
    patch_size: int
    use_bias: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        p = self.patch_size
        batch, height, width, channels = x.shape
        rows, cols = height // p, width // p
        fan_in = p * p * channels
        kernel = self.param(
            "kernel", nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
            (p, p, channels, self.width),
        )
        x, kernel = promote_dtype(x, kernel, dtype=None)
        patches = x[:, : rows * p, : cols * p].reshape(batch, rows, p, cols, p, channels)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows, cols, fan_in)
        y = patches @ kernel.reshape(fan_in, self.width)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.width,)).astype(y.dtype)
        return y


class Attention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` projection and ``proj``."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        if width % self.heads:
            raise ValueError(f"width {width} is not a multiple of heads={self.heads}")
        head_dim = width // self.heads
        qkv = nn.Dense(3 * width, kernel_init=dense_init, name="qkv")(x)
        qkv = qkv.reshape(batch, length, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q * head_dim**-0.5, k)
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
        return nn.Dense(width, kernel_init=dense_init, name="proj")(out)


class Mlp(nn.Module):
    """fc1 -> activation -> fc2."""

    hidden: int
    activation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.Dense(self.hidden, kernel_init=dense_init, name="fc1")(x)
        y = ACTIVATIONS[self.activation](y)
        return nn.Dense(x.shape[-1], kernel_init=dense_init, name="fc2")(y)


class LayerScale(nn.Module):
    """DINOv2's per-channel residual scale ``gamma`` (initialised to ``init_value``)."""

    init_value: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gamma = self.param("gamma", nn.initializers.constant(self.init_value), (x.shape[-1],))
        return x * gamma.astype(x.dtype)


class Block(nn.Module):
    """One pre-norm residual block (module docstring); ``layer_scale`` None: g = 1."""

    heads: int
    epsilon: float
    activation: str
    layer_scale: float | None = None
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = Attention(self.heads, name="attn")(layer_norm(self.epsilon, "norm1")(x))
        if self.layer_scale is not None:
            y = LayerScale(self.layer_scale, name="ls1")(y)
        x = x + y
        y = Mlp(self.mlp_ratio * x.shape[-1], self.activation, name="mlp")(
            layer_norm(self.epsilon, "norm2")(x)
        )
        if self.layer_scale is not None:
            y = LayerScale(self.layer_scale, name="ls2")(y)
        return x + y


def check_grid(x: jax.Array, patch_size: int, image_size: int, network: str) -> None:
    """Rejects images whose patch grid is not the one the position table was built for."""
    grid = image_size // patch_size
    if (x.shape[1] // patch_size, x.shape[2] // patch_size) != (grid, grid):
        raise ValueError(
            f"{network} built for image_size {image_size} (a {grid}x{grid} grid of "
            f"{patch_size}-pixel patches) got images of shape {x.shape} (NHWC); build it "
            f"with the image size the data has"
        )


def embed_tokens(module: nn.Module, x, width, patch_size, image_size, use_bias, inits):
    """Patch embedding (sown as ``stem``), class token and position table of ``module``
    (called inside its ``__call__``): returns the tokens [B, 1 + grid^2, D]."""
    patches = PatchEmbed(width, patch_size, use_bias, name="conv1")(x)
    module.sow(INTERMEDIATES, "stem", patches)
    batch = patches.shape[0]
    tokens = patches.reshape(batch, -1, width)
    class_init, pos_init = inits
    class_embedding = module.param("class_embedding", class_init, (width,))
    pos = module.param("pos_embedding", pos_init, ((image_size // patch_size) ** 2 + 1, width))
    cls = jnp.broadcast_to(class_embedding.astype(tokens.dtype), (batch, 1, width))
    return jnp.concatenate([cls, tokens], axis=1) + pos.astype(tokens.dtype)


def run_blocks(module: nn.Module, x, depth, block_args) -> list:
    """``depth`` blocks ``blocks_0`` .. of ``module`` (inside its ``__call__``), sowing
    MIRO's ``block1`` .. ``block4``; returns every block's output."""
    sown = miro_blocks(depth)
    outputs = []
    for index in range(depth):
        x = Block(**block_args, name=f"blocks_{index}")(x)
        for group, block in enumerate(sown, start=1):
            if block == index:
                module.sow(INTERMEDIATES, f"block{group}", x)
        outputs.append(x)
    return outputs


class ClipViT(nn.Module):
    """CLIP's ViT image tower (ViT-B/16 by default) with DomainBed's head.

    Attributes: num_classes, dropout_rate (on the 512-d feature), input_channels (the
    patch kernel's input channels), image_size (sets the position table), and the
    architecture (ViT-B/16's by default, smaller for tests): patch_size, width, depth,
    heads, output_dim (``proj``'s output, the feature width).
    """

    num_classes: int
    dropout_rate: float = 0.0
    input_channels: int = 3
    image_size: int = 224
    patch_size: int = CLIP_PATCH
    width: int = 768
    depth: int = 12
    heads: int = 12
    output_dim: int = CLIP_FEATURE_DIM

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mixstyle: bool = False, features=False):
        """Logits [B, num_classes] (``features``: ``(feature [B, output_dim], logits)``)
        for normalised NHWC images; ``mixstyle`` is ignored (no MixStyle on a ViT)."""
        del mixstyle
        check_images(x, self.input_channels, "ClipViT")
        check_grid(x, self.patch_size, self.image_size, "ClipViT")
        scale = nn.initializers.normal(self.width**-0.5)
        x = embed_tokens(self, x, self.width, self.patch_size, self.image_size, False,
                         (scale, scale))
        x = layer_norm(CLIP_LAYERNORM_EPS, "ln_pre")(x)
        block_args = {"heads": self.heads, "epsilon": CLIP_LAYERNORM_EPS,
                      "activation": "quick_gelu"}
        x = run_blocks(self, x, self.depth, block_args)[-1]
        pooled = layer_norm(CLIP_LAYERNORM_EPS, "ln_post")(x[:, 0])
        proj = self.param("proj", scale, (self.width, self.output_dim))
        feature = pooled @ proj.astype(pooled.dtype)
        return linear_head(feature, self.num_classes, self.dropout_rate, train, features=features)


class DinoV2ViT(nn.Module):
    """DINOv2's ViT (ViT-B/14 by default) with DomainBed's 5 x width feature and head.

    Attributes: num_classes, dropout_rate (DomainBed's ``vit_dropout``, on the feature),
    image_size (sets the position grid, image_size // patch_size), and the architecture
    (ViT-B/14's by default, smaller for tests): patch_size, width, depth (at least 4),
    heads, layer_scale (LayerScale's initial value, the hub's ``init_values``).
    """

    num_classes: int
    dropout_rate: float = 0.0
    input_channels: int = 3
    image_size: int = 224
    patch_size: int = DINOV2_PATCH
    width: int = 768
    depth: int = 12
    heads: int = 12
    layer_scale: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, mixstyle: bool = False, features=False):
        """Logits [B, num_classes] (``features``: ``(feature [B, 5 * width], logits)``)
        for normalised NHWC images; ``mixstyle`` is ignored (no MixStyle on a ViT)."""
        del mixstyle
        check_images(x, self.input_channels, "DinoV2ViT")
        check_grid(x, self.patch_size, self.image_size, "DinoV2ViT")
        if self.depth < 4:
            raise ValueError(f"DinoV2ViT's feature takes the last 4 blocks; depth={self.depth}")
        inits = (nn.initializers.normal(1e-6), nn.initializers.truncated_normal(0.02))
        x = embed_tokens(self, x, self.width, self.patch_size, self.image_size, True, inits)
        block_args = {"heads": self.heads, "epsilon": DINOV2_LAYERNORM_EPS, "activation": "gelu",
                      "layer_scale": self.layer_scale}
        outputs = run_blocks(self, x, self.depth, block_args)
        norm = layer_norm(DINOV2_LAYERNORM_EPS, "norm")
        last = [norm(out) for out in outputs[-4:]]
        feature = jnp.concatenate(
            [out[:, 0] for out in last] + [jnp.mean(last[-1][:, 1:], axis=1)], axis=-1
        )
        return linear_head(feature, self.num_classes, self.dropout_rate, train, features=features)


def _check_size(image_size: int, patch_size: int, network: str) -> None:
    if image_size < patch_size:
        raise ValueError(
            f"{network} needs images of at least one {patch_size}-pixel patch, got "
            f"image_size={image_size}"
        )


def build_clip_vit_b16(
    num_classes: int,
    *,
    dropout_rate=0.0,
    freeze_batchnorm: bool = True,
    input_channels: int = 3,
    image_size: int = 224,
    **sizes,
) -> ClipViT:
    """CLIP ViT-B/16's image tower with a fresh ``num_classes``-way classifier
    (``freeze_batchnorm``: no BatchNorm here, accepted for the common interface);
    ``sizes`` (``patch_size``, ``width``, ``depth``, ``heads``, ``output_dim``) make a
    reduced network (the tests')."""
    del freeze_batchnorm
    _check_size(image_size, sizes.get("patch_size", CLIP_PATCH), "CLIP ViT")
    return ClipViT(num_classes=num_classes, dropout_rate=dropout_rate,
                   input_channels=input_channels, image_size=image_size, **sizes)


def build_dinov2_vit_b14(
    num_classes: int,
    *,
    dropout_rate=0.0,
    freeze_batchnorm: bool = True,
    input_channels: int = 3,
    image_size: int = 224,
    **sizes,
) -> DinoV2ViT:
    """DINOv2 ViT-B/14 with DomainBed's 3840-d feature and a fresh classifier; ``sizes``
    (``patch_size``, ``width``, ``depth`` >= 4, ``heads``, ``layer_scale``) make a reduced
    network (the tests'). Like DomainBed's ``DinoV2``, it takes 3-channel images only."""
    del freeze_batchnorm
    if input_channels != 3:
        raise ValueError(
            f"DINOv2 ViT-B/14 takes 3-channel images (as DomainBed's DinoV2), got "
            f"input_channels={input_channels}"
        )
    _check_size(image_size, sizes.get("patch_size", DINOV2_PATCH), "DINOv2 ViT")
    return DinoV2ViT(num_classes=num_classes, dropout_rate=dropout_rate, image_size=image_size,
                     **sizes)
