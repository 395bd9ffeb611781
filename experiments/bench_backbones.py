"""Every backbone's SAGM train step and evaluation pass, beside ResNet-50's, in one run.

    python experiments/bench_backbones.py [--archs ...] [--size 224] [--batch 8]
        [--dtypes float32 bfloat16] [--rounds 3] [--steps 2]

For each backbone of ``sagm_jax.models.backbones`` (random weights, a fresh 7-way
classifier, PACS's setting otherwise) it compiles the jitted SAGM train step training
uses (``training.train_step.make_train_step``, the paper's optimizer) and the
evaluation forward; the timing rounds then interleave the backbones, so drift of a noisy
machine hits them alike. A step's time is the median over rounds of (round time /
steps); the evaluation's images/s is the batch over the median forward time. Peak
memory is XLA's buffer plan of the compiled step (arguments + outputs + temporaries,
aliased donations counted once). Prints a Markdown table with each backbone's step as
a multiple of ResNet-50's. On a GPU: ``--batch 96 --dtypes float32 bfloat16`` is the
paper's PACS batch.
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
from sagm_jax.models.backbones import BACKBONES
from sagm_jax.training.train_step import apply_model, create_train_state, make_train_step

ARCHS = ("resnet50", "clip_resnet50", "clip_vit-b16", "dinov2_vitb14", "swag_regnety_16gf")


def compiled_peak(compiled) -> int | None:
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def setup(arch: str, size: int, batch_size: int, dtype: str) -> dict:
    """The compiled SAGM step and evaluation forward of ``arch`` on a constant batch."""
    model = models.create(arch, 7, image_size=size)
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.normal(size=(batch_size, size, size, 3)), jnp.float32),
             "label": jnp.asarray(rng.integers(0, 7, batch_size), jnp.int32)}
    variables = jax.jit(lambda key: model.init(key, batch["image"][:1], train=False))(
        jax.random.key(0))
    optimizer = sagm_jax.paper_optimizer("sagm", learning_rate=3e-5, weight_decay=1e-4)
    step = jax.jit(make_train_step(model, optimizer, algorithm="sagm",
                                   compute_dtype=jnp.dtype(dtype)), donate_argnums=0)
    state = create_train_state(jax.tree.map(jnp.copy, variables), optimizer)  # it is donated
    key = jax.random.key(1)
    start = time.perf_counter()
    compiled = step.lower(state, batch, key).compile()
    state, metrics = step(state, batch, key)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - start
    forward = jax.jit(lambda v, x: apply_model(model, v["params"], v.get("batch_stats", {}), x,
                                               jnp.dtype(dtype), train=False))
    jax.block_until_ready(forward(variables, batch["image"]))
    params = sum(x.size for x in jax.tree.leaves(variables["params"]))
    return {"step": step, "state": state, "batch": batch, "key": key, "forward": forward,
            "variables": variables, "peak": compiled_peak(compiled), "first": first,
            "params": params, "times": [], "eval_times": []}


def time_round(run: dict, steps: int) -> None:
    state = run["state"]
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = run["step"](state, run["batch"], run["key"])
    jax.block_until_ready((state, metrics))
    run["times"].append((time.perf_counter() - start) / steps)
    run["state"] = state
    start = time.perf_counter()
    jax.block_until_ready(run["forward"](run["variables"], run["batch"]["image"]))
    run["eval_times"].append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(BACKBONES))
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    sagm_jax.cpu.configure()  # the XLA options training runs with, before JAX starts
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {platform.machine()}; "
          f"jax {jax.__version__}; SAGM, {args.size}x{args.size}, batch {args.batch}; "
          f"median of {args.rounds} interleaved rounds of {args.steps} steps\n")
    print("| dtype | backbone | parameters (M) | compile + first step (s) | ms/step | "
          "vs resnet50 | evaluation img/s | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        runs = {arch: setup(arch, args.size, args.batch, dtype) for arch in args.archs}
        for _ in range(args.rounds):
            for run in runs.values():
                time_round(run, args.steps)
        base = float(np.median(runs[args.archs[0]]["times"]))
        for arch, run in runs.items():
            step = float(np.median(run["times"]))
            images = args.batch / float(np.median(run["eval_times"]))
            peak = f"{run['peak'] / 2**20:,.0f}" if run["peak"] else "-"
            print(f"| {dtype} | {arch} | {run['params'] / 1e6:.1f} | {run['first']:.1f} | "
                  f"{step * 1000:,.0f} | {step / base:.2f} | {images:,.1f} | {peak} |",
                  flush=True)


if __name__ == "__main__":
    main()
