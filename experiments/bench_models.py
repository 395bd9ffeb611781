"""Throughput of our ResNet-18 and ResNet-50: forward and forward+backward images/s.

    python experiments/bench_models.py [--batch 8] [--sizes 224 64] [--repeats 5]

Each function is jitted and run once before timing (compilation and warm-up are
excluded); the figure is batch / median seconds per call over ``--repeats`` calls,
each waited for with ``block_until_ready``. Forward is evaluation mode; forward+
backward is the gradient of the mean cross-entropy with respect to all
parameters in training mode (BatchNorm frozen, DomainBed's default; dropout 0.5
on the pooled feature). Prints a Markdown table and the device it ran on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from sagm_jax import models


def seconds_per_call(function, *args, repeats: int) -> float:
    jax.block_until_ready(function(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(
    arch: str, size: int, batch: int, repeats: int, num_classes: int = 7
) -> tuple[float, float]:
    model = models.create(arch, num_classes, dropout_rate=0.5)
    images = jax.random.normal(jax.random.PRNGKey(0), (batch, size, size, 3))
    labels = jnp.arange(batch) % num_classes
    variables = jax.jit(lambda key: model.init(key, images, train=False))(jax.random.PRNGKey(1))

    forward = jax.jit(lambda v, x: model.apply(v, x, train=False))

    @jax.jit
    def gradient(v, x, y, key):
        def loss(params):
            logits = model.apply({**v, "params": params}, x, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return jax.grad(loss)(v["params"])

    forward_s = seconds_per_call(forward, variables, images, repeats=repeats)
    backward_s = seconds_per_call(
        gradient, variables, images, labels, jax.random.PRNGKey(2), repeats=repeats
    )
    return batch / forward_s, batch / backward_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[224, 64])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__}, {device.platform} {device.device_kind}, {jax.device_count()} device(s), "
        f"{platform.processor() or platform.machine()}, batch {args.batch}, median of {args.repeats}"
    )
    print("| arch | image size | forward img/s | forward+backward img/s |")
    print("|---|---|---|---|")
    for arch in args.archs:
        for size in args.sizes:
            forward, backward = bench(arch, size, args.batch, args.repeats)
            print(f"| {arch} | {size}x{size} | {forward:.1f} | {backward:.1f} |", flush=True)


if __name__ == "__main__":
    main()
