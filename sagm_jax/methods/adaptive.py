"""Objectives whose prediction adapts to the evaluated batch: ARM and MTL.

This module owns both methods, their own modules (``networks.MethodNetwork``: variables
under ``params["method"]`` and ``batch_stats["method"]``), their prediction (the train
step's forward, the evaluator and ``load_run`` predict through ``networks.MethodModel``)
and their registry entries, as DomainBed's ``domainbed/algorithms.py`` (``ARM``, ``MTL``)
and ``domainbed/networks.py`` (``ContextNet``) state them; the SAGM authors' copies
(``Wang-pengfei/SAGM``, ``domainbed/algorithms/algorithms.py``) are the same.

* ARM (``arm``): a context network c(x) [N, H, W, 1] is averaged over each group of
  ``batch_per_env`` rows and appended to the images as one more channel; the network
  (built for C + 1 channels) classifies the result; the loss is ERM's on that
  prediction. In training the groups are the domains' minibatches.
* MTL (``mtl``): a classifier over [features, domain embedding] (2 d inputs, its own,
  under ``params["method"]``; the network's own classifier is unused). The embedding of
  domain m in training is the EMA ``e_m = ema * mean(phi_m) + (1 - ema) * E_m``
  (``E_m`` <- e_m once per step), at evaluation the evaluated batch's mean feature; the
  reference then overwrites it with N(0, 1) noise (``mtl_embedding``, below).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sagm_jax.methods.networks import BATCH_PER_ENV, MethodNetwork
from sagm_jax.methods.objectives import (
    Step,
    _erm,
    by_domain,
    make_aux,
    per_example_cross_entropy,
)
from sagm_jax.methods.registry import (
    Distribution,
    Hyperparameter,
    Method,
    Objective,
    choice,
    register_objective,
)

# DomainBed's ``ContextNet``: three 5x5 convolutions padded by 2 (the size is kept),
# 64, 64 and 1 output channels, BatchNorm2d and ReLU after the first two.
CONTEXT_WIDTHS = (64, 64, 1)
CONTEXT_KERNEL = 5
BATCHNORM_EPS = 1e-5  # torch's BatchNorm2d
BATCHNORM_MOMENTUM = 0.1  # torch's: running <- (1 - 0.1) running + 0.1 batch
# MTL's N(0, 1) embedding at evaluation, where the reference draws afresh from torch's
# global generator in every call, comes from the key the evaluator folds for each batch
# (``evaluation.batch_key``, from this seed): fresh in every batch, yet deterministic.
# A caller that passes no key (a plain ``model.apply``) draws from PRNGKey(EVAL_NOISE_SEED).
EVAL_NOISE_SEED = 0
# DomainBed's ``misc.accuracy`` predicts its eval loaders' sequential batches of 64.
REFERENCE_EVAL_BATCH = 64


def torch_uniform(key, shape, fan_in: int) -> jax.Array:
    """torch's default Conv2d / Linear init for a weight or bias: U(-1/sqrt(fan_in),
    1/sqrt(fan_in)) (kaiming_uniform with a = sqrt(5))."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


# ----------------------------------------------------------------------------
# ARM's context network (DomainBed's ``ContextNet``).


def init_context_net(key, channels: int) -> tuple[dict, dict]:
    """``(weights, statistics)`` of a fresh context network on ``channels`` input
    channels: convolutions ``conv1..3`` (kernel [5, 5, in, out], bias [out], torch's
    init), BatchNorm ``bn1, bn2`` (scale 1, bias 0; running mean 0, variance 1)."""
    weights, statistics = {}, {}
    keys = jax.random.split(key, 2 * len(CONTEXT_WIDTHS))
    width_in = channels
    for index, width in enumerate(CONTEXT_WIDTHS, start=1):
        fan_in = width_in * CONTEXT_KERNEL**2
        weights[f"conv{index}"] = {
            "kernel": torch_uniform(keys[2 * index - 2],
                                    (CONTEXT_KERNEL, CONTEXT_KERNEL, width_in, width), fan_in),
            "bias": torch_uniform(keys[2 * index - 1], (width,), fan_in),
        }
        if index < len(CONTEXT_WIDTHS):
            weights[f"bn{index}"] = {"scale": jnp.ones(width), "bias": jnp.zeros(width)}
            statistics[f"bn{index}"] = {"mean": jnp.zeros(width), "var": jnp.ones(width)}
        width_in = width
    return weights, statistics


def _conv(x, layer) -> jax.Array:
    """5x5 convolution, stride 1, zero padding 2 on each side, plus bias (NHWC)."""
    pad = (CONTEXT_KERNEL - 1) // 2
    y = jax.lax.conv_general_dilated(
        x, layer["kernel"].astype(x.dtype), (1, 1), ((pad, pad), (pad, pad)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return y + layer["bias"].astype(x.dtype)


def _batchnorm(x, layer, stats, train: bool):
    """torch's BatchNorm2d: ``(y, statistics)``.

    Training: y = (x - mu_B) / sqrt(var_B + 1e-5) * scale + bias, mu_B and the biased
    var_B over (N, H, W); running <- 0.9 running + 0.1 batch, the running variance from
    the unbiased var_B * n / (n - 1), n = N H W (torch's). Evaluation: the running
    statistics, unchanged."""
    if train:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=(0, 1, 2))
        var = x32.var(axis=(0, 1, 2))
        n = x.shape[0] * x.shape[1] * x.shape[2]
        stats = {
            "mean": (1 - BATCHNORM_MOMENTUM) * stats["mean"] + BATCHNORM_MOMENTUM * mean,
            "var": (1 - BATCHNORM_MOMENTUM) * stats["var"]
            + BATCHNORM_MOMENTUM * var * n / max(n - 1, 1),
        }
    else:
        mean, var = stats["mean"], stats["var"]
    y = (x.astype(jnp.float32) - mean) * jax.lax.rsqrt(var + BATCHNORM_EPS)
    return (y * layer["scale"] + layer["bias"]).astype(x.dtype), stats


def context_net(weights, statistics, x, train: bool):
    """c(x) [N, H, W, 1] = conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))) and the BatchNorm
    statistics (updated in training)."""
    updated = {}
    for index in range(1, len(CONTEXT_WIDTHS) + 1):
        x = _conv(x, weights[f"conv{index}"])
        if index < len(CONTEXT_WIDTHS):
            name = f"bn{index}"
            x, updated[name] = _batchnorm(x, weights[name], statistics[name], train)
            x = jax.nn.relu(x)
    return x, updated


def support_groups(n: int, support: int, mask=None) -> tuple[jax.Array, int]:
    """ARM's grouping of a batch of n rows: ``(group id of each row [n], number of ids)``.

    With r real rows (``mask``'s True rows, which come first; all n without a mask):
    groups of ``support`` consecutive rows when ``support`` divides r, else one group of
    all r (DomainBed's ``ARM.predict``: meta batch r / support, else 1 of r). Padding
    rows share the last id, apart from every real row."""
    rows = jnp.arange(n)
    real = jnp.ones(n, bool) if mask is None else jnp.asarray(mask, bool)
    count = real.sum()
    grouped = jnp.where(count % support == 0, rows // support, 0)
    padding_id = -(-n // support)
    return jnp.where(real, grouped, padding_id), padding_id + 1


def group_mean(values, groups, num_groups: int, mask=None) -> jax.Array:
    """Each row's group mean of ``values`` [n, ...] over the real rows of its group."""
    weight = jnp.ones(values.shape[0]) if mask is None else jnp.asarray(mask, values.dtype)
    weight = weight.astype(jnp.float32).reshape(-1, *([1] * (values.ndim - 1)))
    total = jax.ops.segment_sum(values.astype(jnp.float32) * weight, groups, num_groups)
    count = jax.ops.segment_sum(weight, groups, num_groups)
    return (total / jnp.maximum(count, 1.0))[groups]


def _arm_init(key, shapes, hp) -> dict:
    weights, statistics = init_context_net(key, shapes.input_shape[-1])
    return {"params": {"context": weights}, "batch_stats": {"context": statistics}}


def _arm_predict(base, own, images, train, hp, mask=None):
    """x' = [x, mean over x's support group of c(x)] (the context as the last channel),
    then the network on x'. The context network's weights are constants unless
    ``arm_context="trained"`` (the reference never trains them, see the registry entry);
    its BatchNorm trains in training mode over the whole batch."""
    weights = own["params"]["context"]
    if hp["arm_context"] == "untrained":
        weights = jax.lax.stop_gradient(weights)
    context, statistics = context_net(weights, own["batch_stats"]["context"], images, train)
    groups, count = support_groups(images.shape[0], int(hp[BATCH_PER_ENV]), mask)
    pooled = group_mean(context, groups, count, mask).astype(images.dtype)
    out = base(jnp.concatenate([images, pooled], axis=-1))
    return out, ({"context": statistics} if train else None)


register_objective(Objective(
    Method("arm", "ARM", (
        Hyperparameter(
            "arm_context", "untrained",
            'ARM\'s context network: "untrained" (DomainBed: its optimizer omits it) or '
            '"trained"', "one of untrained, trained"),
    ), "ERM on images with a context channel averaged over each batch_per_env rows",
        "DomainBed (Zhang et al. 2021)", (85.1, 77.6, 64.8, 45.5, 35.5, 61.7, "DomainBed")),
    _erm,
    label_alone=True,
    network=MethodNetwork(init=_arm_init, predict=_arm_predict, extra_input_channels=1,
                          uses_mask=True, eval_batch_size=REFERENCE_EVAL_BATCH,
                          frozen=lambda hp: ("context",) if hp["arm_context"] == "untrained"
                          else ()),
))


# ----------------------------------------------------------------------------
# MTL (DomainBed's ``MTL``).


def mtl_classify(params, features, embedding) -> jax.Array:
    """MTL's classifier: [features, embedding] @ kernel + bias, in float32."""
    joined = jnp.concatenate([features, embedding], axis=-1).astype(jnp.float32)
    return joined @ params["kernel"] + params["bias"]


def embedding_noise(key, shape) -> jax.Array:
    """MTL's N(0, 1) embedding draws of ``shape`` from ``key`` (the reference's
    ``.normal_()``), independent for every row and coordinate."""
    return jax.random.normal(key, shape, jnp.float32)


def _mtl_init(key, shapes, hp) -> dict:
    """The classifier on 2 d inputs (torch's Linear init) and the embeddings E = 0 [M, d]."""
    d, fan_in = shapes.feature_dim, 2 * shapes.feature_dim
    kernel_key, bias_key = jax.random.split(key)
    classifier = {"kernel": torch_uniform(kernel_key, (fan_in, shapes.num_classes), fan_in),
                  "bias": torch_uniform(bias_key, (shapes.num_classes,), fan_in)}
    return {"params": {"classifier": classifier},
            "batch_stats": {"embeddings": jnp.zeros((shapes.num_domains, d), jnp.float32)}}


def _mtl_predict(base, own, images, train, hp, mask=None, key=None):
    """Evaluation (``env=None``): the embedding is the mean feature of the evaluated
    batch's real rows, replaced by N(0, 1) draws from ``key`` (the batch's) with
    ``mtl_embedding="noise"``; then MTL's classifier. Training passes the network's output through: the objective
    computes the prediction (it needs the domains, E and the step's key)."""
    features, logits = base(images)
    if train:
        return (features, logits), None
    if hp["mtl_embedding"] == "noise":
        key = jax.random.PRNGKey(EVAL_NOISE_SEED) if key is None else key
        embedding = embedding_noise(key, features.shape)
    else:
        rows = jnp.zeros(features.shape[0], jnp.int32)
        embedding = group_mean(features, rows, 1, mask)
    return (features, mtl_classify(own["params"]["classifier"], features, embedding)), None


def _mtl(args: Step):
    """L = sum_m CE(W [phi_m, e_m] + b, y_m) (a sum over domains, DomainBed's), with
    e_m = ema * mean_i phi_mi + (1 - ema) * E_m, differentiated through the mean, and
    E_m <- stop_gradient(e_m) once per step (the clean pass, ``advance``). With
    ``mtl_embedding="noise"`` (the reference's ``.normal_()``) every row's embedding is
    an N(0, I) draw from the objective's key instead, so E advances unused.

    E lives in ``batch_stats["method"]["embeddings"]``; the loss returns it updated
    through ``Aux.batch_stats``, which the train step keeps from the clean pass only."""
    out = args.forward(args.images)
    m, ema = args.num_domains, args.hp["mtl_ema"]
    features = by_domain(out.features.astype(jnp.float32), m)
    stored = out.batch_stats["method"]["embeddings"]
    current = ema * features.mean(axis=1) + (1.0 - ema) * stored
    if args.hp["mtl_embedding"] == "noise":
        embedding = embedding_noise(args.key, features.shape)
    else:
        embedding = jnp.broadcast_to(current[:, None, :], features.shape)
    logits = mtl_classify(args.params["method"]["classifier"], features, embedding)
    losses = jax.vmap(per_example_cross_entropy)(logits, by_domain(args.labels, m)).mean(1)
    loss = losses.sum()
    embeddings = jax.lax.stop_gradient(current) if args.advance else stored
    own = {**out.batch_stats["method"], "embeddings": embeddings}
    out = out._replace(batch_stats={**out.batch_stats, "method": own})
    return loss, make_aux(args, out, {"loss": loss}, losses)


# DomainBed's r.choice([0.5, 0.9, 0.99, 1.]), written as its values print.
_MTL_EMA_DRAW = Distribution("{0.5, 0.9, 0.99, 1.0}", choice((0.5, 0.9, 0.99, 1.0)).draw)
register_objective(Objective(
    Method("mtl", "MTL", (
        Hyperparameter("mtl_ema", 0.99, "weight of the batch mean in MTL's domain-embedding EMA",
                       "[0, 1]", _MTL_EMA_DRAW),
        Hyperparameter(
            "mtl_embedding", "noise",
            'MTL\'s embedding input: "noise" (DomainBed\'s .normal_() overwrites it with '
            'N(0, 1)) or "mean" (the EMA / batch-mean feature)', "one of noise, mean"),
    ), "sum of domain losses of a classifier on [features, domain-mean embedding]",
        "DomainBed (Blanchard et al. 2021)", (84.6, 77.2, 66.4, 45.6, 40.6, 62.9, "DomainBed")),
    _mtl,
    label_alone=True,
    network=MethodNetwork(init=_mtl_init, predict=_mtl_predict, uses_mask=True,
                          uses_key=True, eval_batch_size=REFERENCE_EVAL_BATCH),
))
