"""The train step of a pack of R runs: run-steps per second against R, vmapped or looped.

    python experiments/bench_packed_steps.py --model digits --packs 1 2 6 18
    python experiments/bench_packed_steps.py --model mnist --packs 1 8 32 128     # a GPU
    python experiments/bench_packed_steps.py --model resnet50 --packs 1 2 4       # a GPU

Models: ``digits`` is ``configs/rotated_digits.py`` (the quarter-width MNIST CNN, 16 per
domain, 5 training domains); ``mnist`` DomainBed's RotatedMNIST network (full width, 64
per domain, 5 training domains); ``resnet50`` PACS's ResNet-50 (224 x 224, 32 per
domain, 3 training domains, random weights). The batches are synthetic float images
(no input pipeline, no TensorFlow: the step alone). Each run of a pack has its own
learning rate and seed, as in a sweep. For each R and each ``--lanes`` mode
(``sagm_jax.training.packed``: ``vmap``, one vmapped program; ``loop``, the runs
stepped one after the other by one compiled step) it prints the first step (compile)
time, the step time, run-steps per second, their ratio to R = 1, and on accelerators
the device's peak memory. Each (lanes, R) runs in a process of its own, so that its
peak memory is its own. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sagm_jax.config import mnist_config, resnet50_config
from sagm_jax.methods import networks
from sagm_jax.training import packed


def base_config(model: str, algorithm: str):
    if model == "resnet50":
        config = resnet50_config("PACS")
        config.pretrained_weights = "none"
        config.batch_per_env, classes, shape, domains = 32, 7, (224, 224, 3), 3
    else:
        config = mnist_config("RotatedMNIST")
        if model == "digits":
            config.cnn_widths, config.batch_per_env = (16, 32, 32, 32), 16
        classes, shape, domains = 10, (28, 28, 1), 5
    config.algorithm = algorithm
    return config, classes, shape, domains


def measure(model_name, algorithm, runs, lanes, steps):
    config, classes, shape, domains = base_config(model_name, algorithm)
    model, variables, _ = networks.from_config(config, classes, shape, domains,
                                               jax.random.key(0), pretrained=False)
    configs = []
    for r in range(runs):
        run = config.copy_and_resolve_references()
        run.lr, run.seed = config.lr * (1 + r / runs), r
        configs.append(run)
    values = packed.varying_values(configs)
    states = packed.packed_initial_states(config, values, [variables] * runs, domains)
    keys = jnp.stack([jax.random.key(r) for r in range(runs)])
    rows = config.batch_per_env * domains
    rng = np.random.default_rng(0)
    batches = {
        "image": jnp.asarray(rng.standard_normal((runs, rows, *shape), np.float32)),
        "label": jnp.asarray(rng.integers(0, classes, (runs, rows)), jnp.int32),
    }
    device = jax.devices()[0]
    if lanes == "vmap":
        lanes_ = packed.VmapLanes(config, model, domains, states, values, keys,
                                  jax.sharding.Mesh(np.array([device]), (packed.RUNS,)))
    else:
        lanes_ = packed.LoopLanes(config, model, domains, states, values, keys, device)
    active = np.ones(runs, bool)
    start = time.perf_counter()
    lanes_.step(batches, active)
    jax.block_until_ready(lanes_.lane(0))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        lanes_.step(batches, active)
    jax.block_until_ready([lanes_.lane(r) for r in range(runs)])
    step = (time.perf_counter() - start) / steps
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return first, step, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["digits", "mnist", "resnet50"], default="digits")
    parser.add_argument("--algorithm", default="sagm")
    parser.add_argument("--packs", nargs="+", type=int, default=[1, 2, 6, 18])
    parser.add_argument("--lanes", nargs="+", choices=packed.LANES, default=list(packed.LANES))
    parser.add_argument("--steps", type=int, default=10, help="Timed steps after the first.")
    parser.add_argument("--one", action="store_true",
                        help="measure the first of --lanes and --packs; print one JSON line")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.algorithm, args.packs[0], args.lanes[0],
                                 args.steps)))
        return
    print(f"# {args.model}, {args.algorithm}, on {jax.devices()[0].device_kind} "
          f"({jax.default_backend()})\n")
    print("| lanes | R | first step (s) | step (ms) | run-steps/s | vs R=1 | peak memory |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for lanes in args.lanes:
        for runs in args.packs:
            one = [sys.executable, __file__, "--one", "--model", args.model, "--algorithm",
                   args.algorithm, "--packs", str(runs), "--lanes", lanes,
                   "--steps", str(args.steps)]
            done = subprocess.run(one, capture_output=True, text=True, check=True)
            first, step, peak = json.loads(done.stdout.strip().splitlines()[-1])
            rate = runs / step
            base.setdefault(lanes, rate)
            memory = f"{peak / 2**30:.2f} GiB" if peak else "-"
            print(f"| {lanes} | {runs} | {first:.1f} | {step * 1000:.0f} | {rate:.1f} | "
                  f"{rate / base[lanes]:.2f}x | {memory} |", flush=True)


if __name__ == "__main__":
    main()
