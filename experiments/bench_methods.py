"""Train-step time of every registered method on the offline RotatedDigits run, in one run.

    python experiments/bench_methods.py [--rounds 5] [--steps 4] [--methods NAME ...]

A method is an objective with the ``erm`` update rule, or an update rule (a
sharpness-aware head or a procedure) with the ``erm`` objective, as the registries
(``sagm_jax.methods.registry``: OBJECTIVES, UPDATE_RULES) list them; ``erm`` is both.
Each is built as a run builds it (``sagm_jax.training.train.setup`` on
``configs/rotated_digits.py``: 5 training domains x 16 images, the 16-32-32-32 CNN,
one device), so the step timed is the run's jitted step, device augmentation included,
on one real batch of the run's first step. Every method's step is compiled first (the
compile time is reported apart); then the timing rounds interleave the methods, so a
noisy machine's drift hits them alike. A step's time is the median over rounds of
(round time / steps); ``--steps`` even, so that DANN's alternating steps are half each.

``passes`` is what a step should cost from the passes it makes over the whole batch,
in units of ERM's step (one forward-backward of the network): a forward alone counts
1/3 (a backward costs about twice its forward), and the methods' small heads count
nothing. ``time/passes`` is the step's time over ERM's times its passes: about 1 when a
method costs what its passes predict. ``flops`` is XLA's count for the compiled step
(``compiled.cost_analysis()``) over ERM's, a check of ``passes`` that owes nothing to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax
import numpy as np

import sagm_jax.cpu
from sagm_jax.methods.registry import OBJECTIVES, UPDATE_RULES

F = 1 / 3  # a forward pass alone, in forward-backward passes
M, N_META_TEST = 5, 2  # RotatedDigits with test_envs (0,): 5 training domains; MLDG's default
# Passes over the whole batch per step (a pass over one domain's minibatch counts 1/M).
PASSES = {
    "erm": 1, "mixup": 1, "cutmix": 1, "org_mixup": 1, "coral": 1, "mmd": 1,
    "groupdro": 1, "irm": 1, "vrex": 1, "rsc": 1, "selfreg": 1, "mtl": 1,
    "sd": 1, "causirl_coral": 1, "causirl_mmd": 1, "ib_erm": 1, "ib_irm": 1, "eqrm": 1,
    "cad": 1, "condcad": 1,
    # Fishr: the per-example gradients and their backward are of the linear head only.
    "fishr": 1,
    # ARM: the context network's forward (5x5 convolutions 1-64-64-1 at 28x28: 82.8M
    # multiply-adds an image) against the CNN's forward-backward (3 x 4.63M).
    "arm": 1 + 82.8 / (3 * 4.63),
    "miro": 1 + F,  # the frozen oracle's forward
    "sam": 2, "gsam": 2, "sagm": 2, "erm_sam": 2,
    "fish": 1, "and_mask": 1, "sand_mask": 1,
    "mldg": 2 * (M - N_META_TEST) / M,  # M - n pairs of two one-domain passes
    "dann": 1,  # the featurizer's forward-backward every step, as DomainBed's
    "cdann": 1,
    "sagnet": 2 + F,  # content and adversarial passes, the style pass forward only
    # mDSDI: both encoders in the main loss; the meta step passes the batch twice (the
    # meta-train passes at theta, one per domain, then the meta-test ones at theta'),
    # both encoders forward, zs backward. The authors' code passes it D times.
    "mdsdi": 2 + 2 * (1 + F),
    "urm": 1,  # one forward-backward; the discriminator (an MLP on the features) aside
    # Transfer: the whole batch's forward-backward, the gap step's (one pass per domain),
    # and d_steps_per_g = 10 forward passes for the head's inner steps (equal without
    # dropout, so XLA may compute them once).
    "transfer": 2 + 10 * F,
    "rdm": 1,
    # IGA: each domain's forward-backward over its rows (one pass in all), and the step's
    # gradient of those gradients (a second-order backward, about twice that again).
    "iga": 3,
    "trm": 1,  # one forward-backward; the heads' SGD and Neumann terms are linear maps
    "adrmx": 2,  # both featurizers' forward-backward every step; the heads and MLP aside
}


def methods() -> list[tuple[str, str]]:
    """(objective, update rule) of every registered method, ERM first."""
    pairs = [(objective, "erm") for objective in OBJECTIVES]
    return pairs + [("erm", rule) for rule in UPDATE_RULES if rule != "erm"]


def method_name(objective: str, rule: str) -> str:
    return rule if objective == "erm" else objective


def build(objective: str, rule: str):
    """The run's jitted step, initial state and one batch of its first step."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import rotated_digits

    from sagm_jax.config import validate
    from sagm_jax.data.pipeline import prefetch_to_mesh
    from sagm_jax.training.train import setup

    config = rotated_digits.get_config()
    config.objective, config.algorithm, config.num_devices = objective, rule, 1
    validate(config, device_count=jax.device_count())
    program = setup(config)
    batches = prefetch_to_mesh(
        program.dataset.train_iterator(program.train_envs, seed=config.seed,
                                       batch_per_env=config.batch_per_env, start_step=0),
        program.mesh)
    batch = next(batches)
    batches.close()
    key = jax.random.split(jax.random.key(config.seed))[1]
    return program.train_step, program.state, batch, key


def bench(names: list[str], rounds: int, steps: int) -> dict:
    runs = {}
    for objective, rule in methods():
        name = method_name(objective, rule)
        if name not in names:
            continue
        step, state, batch, key = build(objective, rule)
        start = time.perf_counter()
        compiled = step.lower(state, batch, key).compile()
        compile_s = time.perf_counter() - start
        cost = compiled.cost_analysis()
        flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
        state, metrics = compiled(state, batch, key)  # warm-up
        jax.block_until_ready(metrics)
        runs[name] = {"step": compiled, "state": state, "batch": batch, "key": key,
                      "compile": compile_s, "flops": flops, "times": []}
        print(f"compiled {name} in {compile_s:.1f} s", file=sys.stderr, flush=True)
    for _ in range(rounds):
        for run in runs.values():
            state = run["state"]
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = run["step"](state, run["batch"], run["key"])
            jax.block_until_ready((state, metrics))
            run["times"].append((time.perf_counter() - start) / steps)
            run["state"] = state
    return {name: (float(np.median(r["times"])), r["compile"], r["flops"])
            for name, r in runs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    all_names = [method_name(*pair) for pair in methods()]
    parser.add_argument("--methods", nargs="*", default=all_names, choices=all_names)
    args = parser.parse_args()
    if args.steps % 2:
        parser.error(f"--steps {args.steps}: expected an even number (DANN alternates)")
    names = list(dict.fromkeys(["erm", "sagm", *args.methods]))  # the ratios' references
    sagm_jax.cpu.configure()  # the XLA options training runs with, before JAX starts
    results = bench(names, args.rounds, args.steps)
    print(
        f"device: {jax.devices()[0].device_kind} x{jax.device_count()} "
        f"({os.cpu_count()} cores), {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}; configs/rotated_digits.py (batch 80); "
        f"{args.rounds} interleaved rounds of {args.steps} steps"
    )
    (erm, _, erm_flops), sagm = results["erm"], results["sagm"][0]
    print("| method | ms/step | vs ERM | vs SAGM | passes | flops | time/passes | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (seconds, compile_s, flops) in results.items():
        print(f"| {name} | {1e3 * seconds:.1f} | {seconds / erm:.2f} | {seconds / sagm:.2f} "
              f"| {PASSES[name]:.2f} | {flops / erm_flops:.2f} "
              f"| {seconds / (erm * PASSES[name]):.2f} | {compile_s:.1f} |")


if __name__ == "__main__":
    main()
