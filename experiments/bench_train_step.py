"""Train-step time of ERM, SAM, GSAM and SAGM on the same model and batch, in one run.

    python experiments/bench_train_step.py [--rounds 5] [--steps 3] [--setups NAME ...]

For each model, every algorithm's jitted step (sagm_jax.training.train_step, the one
training uses) is compiled first; then the timing rounds interleave the
algorithms, so drift of a noisy machine hits them alike. A step's time is the
median over rounds of (round time / steps). Peak memory is XLA's buffer plan for
the compiled step (arguments + outputs + temporaries, aliased donations counted
once), from ``compiled.memory_analysis()``.

Goals: SAGM/SAM <= 1.03 (same two passes); SAGM/ERM <= 2.05 (two
forward-backward passes are the floor). Setups: a small CNN (DomainBed's MNIST
CNN) and ResNet-18 at a small resolution; the offline default's network and
batch (configs/rotated_digits.py); ResNet-50 at 224 (the paper's model, a small
batch on CPU; `--batch 96` for the paper's on an accelerator). Every registered
method's step (objectives, heads, procedures) against ERM's and SAGM's:
experiments/bench_methods.py.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import sagm_jax
import sagm_jax.cpu
from sagm_jax import models
from sagm_jax.training.train_step import create_train_state, make_train_step

ALGORITHMS = ("erm", "sam", "gsam", "sagm")
SETUPS = {
    # name: (arch, model kwargs, image shape, batch size)
    "mnist_cnn 28x28x1": ("mnist_cnn", {"input_channels": 1}, (28, 28, 1), 64),
    "resnet18 64x64x3": ("resnet18", {"dropout_rate": 0.5}, (64, 64, 3), 32),
    "rotated_digits default": (
        "mnist_cnn",
        {"input_channels": 1, "cnn_widths": (16, 32, 32, 32)},
        (28, 28, 1),
        80,
    ),
    "resnet50 224x224x3": ("resnet50", {"dropout_rate": 0.5}, (224, 224, 3), 8),
}


def bench_setup(name, rounds, steps, batch_size=None, compute_dtype="float32"):
    arch, kwargs, shape, default_batch = SETUPS[name]
    batch_size = batch_size or default_batch
    model = models.create(arch, 10, **kwargs)
    rng = np.random.default_rng(0)
    batch = {
        "image": jnp.asarray(rng.normal(size=(batch_size, *shape)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32),
    }
    variables = model.init(jax.random.key(0), batch["image"], train=False)
    key = jax.random.key(1)

    runs = {}
    for algorithm in ALGORITHMS:
        opt = sagm_jax.paper_optimizer(algorithm, learning_rate=1e-5, weight_decay=1e-4)
        step = jax.jit(
            make_train_step(
                model, opt, algorithm=algorithm, compute_dtype=jnp.dtype(compute_dtype)
            ),
            donate_argnums=0,
        )
        # A copy each: the step donates its state, and the algorithms must not share buffers.
        state = create_train_state(jax.tree.map(jnp.copy, variables), opt)
        compiled = step.lower(state, batch, key).compile()
        memory = compiled.memory_analysis()
        peak = (
            None
            if memory is None
            else (
                memory.argument_size_in_bytes
                + memory.output_size_in_bytes
                + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes
            )
        )
        state, metrics = step(state, batch, key)  # warm-up
        jax.block_until_ready(metrics)
        runs[algorithm] = {"step": step, "state": state, "times": [], "peak": peak}

    for _ in range(rounds):
        for algorithm in ALGORITHMS:
            run = runs[algorithm]
            state = run["state"]
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = run["step"](state, batch, key)
            jax.block_until_ready((state, metrics))
            run["times"].append((time.perf_counter() - start) / steps)
            run["state"] = state
    return {a: (float(np.median(r["times"])), r["peak"]) for a, r in runs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--batch", type=int, default=None, help="override every setup's batch")
    parser.add_argument("--compute_dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    sagm_jax.cpu.configure()  # the XLA options training runs with, before JAX starts
    print(
        f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}; "
        f"{args.rounds} interleaved rounds of {args.steps} steps, {args.compute_dtype}"
    )
    print("| model | batch | algorithm | ms/step | steps/s | examples/s | peak MiB | vs ERM |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.setups:
        batch = args.batch or SETUPS[name][3]
        results = bench_setup(name, args.rounds, args.steps, batch, args.compute_dtype)
        erm_time = results["erm"][0]
        for algorithm, (seconds, peak) in results.items():
            peak_text = "n/a" if peak is None else f"{peak / 2**20:.1f}"
            print(
                f"| {name} | {batch} | {algorithm} | {1e3 * seconds:.1f} | {1 / seconds:.2f} "
                f"| {batch / seconds:.1f} | {peak_text} | {seconds / erm_time:.2f} |"
            )
        print(
            f"| {name} | | SAGM/SAM = {results['sagm'][0] / results['sam'][0]:.3f} "
            f"| SAGM/ERM = {results['sagm'][0] / erm_time:.3f} | | | | |"
        )


if __name__ == "__main__":
    main()
