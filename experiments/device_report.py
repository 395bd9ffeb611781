"""One command for the figures of a machine: step times, device augmentation, a real loop.

    python experiments/device_report.py [--sections steps augment loop] [--json OUT.json]

Runs on any machine JAX runs on (CPU, one GPU, ...) and needs only JAX, flax, optax,
orbax-checkpoint, NumPy, Pillow, tqdm and ml-collections (a pure-Python wheel): no
TensorFlow. Defaults are the paper's setting: ResNet-50 at 224x224, batch 96 (32 per
training domain x 3).

- ``steps``: ERM, SAM, GSAM and SAGM train-step times in float32 and bfloat16 on a
  constant batch (``bench_train_step.bench_setup``: the jitted step training uses,
  algorithms interleaved per round): ms/step, img/s, SAGM/SAM, SAGM/ERM, and the
  compiled step's peak memory (XLA's buffer plan).
- ``augment``: ``device_augment.augment_batch`` alone on batches of uint8 canvases
  (227x227 as PACS, 320x427 as a capped photo): img/s, and its time as a fraction of
  the SAGM step on the same batch size.
- ``loop``: a PACS-like folder (4 domains x 7 classes of 227x227 JPEGs, written
  here) opened as training opens it (``sagm_jax.data.from_config``: the decoded
  store, built once and timed), then ``--loop_steps`` steps of the real loop
  (``train_iterator`` -> ``prefetch_to_mesh`` -> ``train_step.data_parallel_train_step``'s
  jitted step with the device augmentation; the loss read every 10 steps as the run loop does), against
  the same step on one constant batch already on the device, in alternating
  chunks. Input-bound fraction = loop steps/s / constant-batch steps/s. Also: seconds
  per evaluation pass over every split of the folder (``evaluation.Evaluator``).
- ``eval``: the evaluator against the forward pass. The same PACS-like folder, every
  split part evaluated (``eval_splits="all"``) with the run's evaluator
  (``evaluation.Evaluator``, ``--loop_dtype``, its default batch): images/s of the first
  evaluation (reads the store, keeps the inputs), of later ones with the inputs kept
  resident, and of later ones with nothing kept (read from the store each time), against
  the forward-only images/s of the same model on one constant batch of the same size
  already on the device (normalisation + ``apply_model``), timed in alternating rounds.
  Ratio = resident evaluation images/s / forward-only images/s (goal >= 0.9); padding
  rows count as cost, not as images.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import bench_input  # experiments/, the script's own folder
import bench_train_step
from sagm_jax.data import device_augment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALGORITHMS = bench_train_step.ALGORITHMS


def device_line() -> str:
    d = jax.devices()[0]
    return (
        f"{d.platform}: {d.device_kind} x{jax.device_count()}; host {platform.machine()}, "
        f"{os.cpu_count()} CPUs; jax {jax.__version__}"
    )


def section_steps(args, report):
    name = "device report"
    bench_train_step.SETUPS[name] = (
        args.arch,
        {"dropout_rate": 0.5, "image_size": args.image_size},
        (args.image_size, args.image_size, 3),
        args.batch,
    )
    print(f"\n## Train step: {args.arch} {args.image_size}x{args.image_size}, batch {args.batch}")
    print("| dtype | algorithm | ms/step | img/s | vs ERM | peak MiB |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        results = bench_train_step.bench_setup(name, args.rounds, args.steps, args.batch, dtype)
        erm = results["erm"][0]
        for algorithm, (seconds, peak) in results.items():
            peak_text = "n/a" if peak is None else f"{peak / 2**20:,.0f}"
            print(
                f"| {dtype} | {algorithm} | {1e3 * seconds:.1f} | {args.batch / seconds:,.0f} "
                f"| {seconds / erm:.3f} | {peak_text} |",
                flush=True,
            )
        sagm, sam = results["sagm"][0], results["sam"][0]
        print(f"| {dtype} | SAGM/SAM {sagm / sam:.3f}, SAGM/ERM {sagm / erm:.3f} | | | | |")
        report["steps"][dtype] = {a: {"seconds": s, "peak_bytes": p} for a, (s, p) in results.items()}


def _time(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def section_augment(args, report):
    print(f"\n## Device augmentation, batch {args.batch} -> {args.image_size}x{args.image_size}")
    augment = jax.jit(lambda keys, x, hw: device_augment.augment_batch(keys, x, hw, args.image_size))
    rng = np.random.default_rng(0)
    keys = device_augment.example_keys(0, device_augment.TRAIN_STREAM, 0, jnp.arange(args.batch))
    sagm = report["steps"].get("bfloat16", report["steps"].get("float32", {})).get("sagm")
    print("| canvas | ms/batch | img/s | fraction of the SAGM step |")
    print("|---|---|---|---|")
    for h, w in ((227, 227), (320, 427)):
        x = jnp.asarray(rng.integers(0, 256, (args.batch, h, w, 3), dtype=np.uint8))
        hw = jnp.asarray(np.tile([h, w], (args.batch, 1)).astype(np.int32))
        seconds = _time(augment, keys, x, hw, repeats=args.steps * 2)
        fraction = f"{seconds / sagm['seconds']:.3f}" if sagm else "n/a (run 'steps')"
        print(f"| {h}x{w} | {1e3 * seconds:.2f} | {args.batch / seconds:,.0f} | {fraction} |")
        report["augment"][f"{h}x{w}"] = seconds


def pacs_like_config(folder, cache_dir, args, **overrides):
    """``configs/pacs.py`` on the PACS-like folder ``folder`` (random weights, domain 3
    held out) at ``args.arch`` and ``args.image_size``, with ``overrides``."""
    from sagm_jax import cli

    config = cli.load_config_file(os.path.join(REPO, "configs", "pacs.py"))
    config.update(
        dataset="ImageFolder",
        data_dir=folder,
        pretrained_weights="none",
        arch=args.arch,
        image_size=args.image_size,
        cache_dir=cache_dir,
        test_envs=(3,),
    )
    config.update(overrides)
    return config


def section_loop(args, report):
    from sagm_jax.training import train
    from sagm_jax.data.pipeline import prefetch_to_mesh

    tmp = tempfile.mkdtemp(prefix="device_report_")
    folder = os.path.join(tmp, "data")
    start = time.perf_counter()
    bench_input.write_tree(folder, 227, 227, args.images_per_class)
    print(f"\n## Real loop on a PACS-like folder ({time.perf_counter() - start:.0f} s to write it)")
    config = pacs_like_config(
        folder,
        os.path.join(tmp, "cache"),
        args,
        batch_per_env=args.batch // 3,
        compute_dtype=args.loop_dtype,
    )
    start = time.perf_counter()
    program = train.setup(config)  # opens the data (builds the store), model, steps
    dataset, mesh, train_step, state = (
        program.dataset, program.mesh, program.train_step, program.state
    )
    n_images = sum(dataset.env_sizes)
    build = time.perf_counter() - start
    print(f"set up, store built: {n_images} images in {build:.1f} s ({n_images / build:,.0f}/s)")
    key = jax.random.key(1)
    batches = prefetch_to_mesh(
        dataset.train_iterator([0, 1, 2], seed=0, batch_per_env=config.batch_per_env), mesh
    )
    constant = next(batches)
    for _ in range(3):  # compile and warm up
        state, metrics = train_step(state, next(batches), key)
    float(metrics["loss"])

    def run(n, feed):
        nonlocal state
        t0 = time.perf_counter()
        for t in range(n):
            state, metrics = train_step(state, feed(), key)
            if t % 10 == 0:
                float(metrics["loss"])  # the run loop reads the loss every log_every=10
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    chunk = max(1, args.loop_steps // args.rounds)
    real = const = 0.0
    for _ in range(args.rounds):
        real += run(chunk, lambda: next(batches))
        const += run(chunk, lambda: constant)
    steps = chunk * args.rounds
    fraction = const / real
    print(f"| input | steps | steps/s | img/s |\n|---|---|---|---|")
    print(f"| real loop (store -> prefetch -> device augmentation) | {steps} | {steps / real:.2f} "
          f"| {steps * args.batch / real:,.0f} |")
    print(f"| constant batch on the device | {steps} | {steps / const:.2f} "
          f"| {steps * args.batch / const:,.0f} |")
    print(f"input-bound fraction (real / constant steps/s): {fraction:.3f}")
    program.evaluator(state)  # compile
    start = time.perf_counter()
    program.evaluator(state)
    evaluation = time.perf_counter() - start
    print(f"evaluation pass (eval_splits={config.eval_splits!r}) of the {n_images} images: "
          f"{evaluation:.2f} s")
    report["loop"] = {
        "images": n_images,
        "store_build_s": build,
        "steps": steps,
        "loop_steps_per_s": steps / real,
        "constant_steps_per_s": steps / const,
        "input_bound_fraction": fraction,
        "eval_pass_s": evaluation,
        "dtype": args.loop_dtype,
    }


def section_eval(args, report):
    from sagm_jax.training import evaluation
    from sagm_jax.training import train
    from sagm_jax.data.pipeline import eval_blocks
    from sagm_jax.training.train_step import apply_model

    tmp = tempfile.mkdtemp(prefix="device_report_eval_")
    folder = os.path.join(tmp, "data")
    bench_input.write_tree(folder, 227, 227, args.images_per_class)
    config = pacs_like_config(
        folder, os.path.join(tmp, "cache"), args, compute_dtype=args.loop_dtype, eval_splits="all"
    )
    program = train.setup(config)
    state, evaluator, dataset = program.state, program.evaluator, program.dataset
    images = sum(len(dataset.splits[e][p]) for e, p in evaluator.parts)
    batch = evaluator.batch_size
    rows = sum(  # padding included: what the device computes
        position.size
        for e, p in evaluator.parts
        for position, _ in eval_blocks(len(dataset.splits[e][p]), batch, multiple=program.mesh.size)
    )
    print(f"\n## Evaluation against the forward pass: {args.arch} {args.image_size}x"
          f"{args.image_size}, {args.loop_dtype}, batch {batch}, {images} images a pass")
    start = time.perf_counter()
    evaluator(state)  # compiles, reads the store, keeps the inputs
    first = time.perf_counter() - start
    kept = {k: v / 2**20 for k, v in evaluator.kept_bytes.items()}
    budgets = evaluation.residency_budgets
    evaluation.residency_budgets = lambda config, device: {"device": 0, "host": 0}
    try:
        streamed = evaluation.Evaluator(
            program.model, dataset, program.mesh, config, program.train_envs
        )
        streamed(state)  # compiles
    finally:
        evaluation.residency_budgets = budgets
    host = next(dataset.eval_iterator(0, "in", batch_size=batch))
    constant = jax.device_put({"image": host["image"][:batch]})
    while constant["image"].shape[0] < batch:  # a part smaller than the batch: repeat it
        constant = {"image": jnp.concatenate([constant["image"]] * 2)[:batch]}
    dtype = jnp.dtype(config.compute_dtype)

    @jax.jit
    def forward(params, batch_stats, images):
        inputs = device_augment.model_inputs({"image": images}, 0, 0, args.image_size)
        return apply_model(program.model, params, batch_stats, inputs["image"], dtype)

    n_batches = -(-images // batch)
    forward(state.params, state.batch_stats, constant["image"]).block_until_ready()
    times = {"resident": 0.0, "streamed": 0.0, "forward": 0.0}
    for _ in range(args.rounds):
        for name, run in (("resident", evaluator), ("streamed", streamed)):
            start = time.perf_counter()
            run(state)
            times[name] += time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(n_batches):
            out = forward(state.params, state.batch_stats, constant["image"])
        out.block_until_ready()
        times["forward"] += time.perf_counter() - start
    rates = {k: args.rounds * images / t for k, t in times.items()}
    rates["forward"] = args.rounds * n_batches * batch / times["forward"]
    ratio = rates["resident"] / rates["forward"]
    print("| pass | images/s |\n|---|---|")
    print(f"| first evaluation (compile, read the store, keep) | {images / first:,.0f} |")
    print(f"| evaluation, inputs kept ({kept['device']:.0f} MiB on the device, "
          f"{kept['host']:.0f} MiB in host memory) | {rates['resident']:,.0f} |")
    print(f"| evaluation, inputs read from the store each time | {rates['streamed']:,.0f} |")
    print(f"| forward only, one constant batch of {batch} on the device "
          f"| {rates['forward']:,.0f} |")
    print(f"evaluation / forward-only images/s: {ratio:.3f} (goal >= 0.9)")
    print(f"the same per computed row ({rows - images} of the {rows} rows are padding of "
          f"the parts' last batches): {ratio * rows / images:.3f}")
    report["eval"] = {
        "images": images,
        "batch": batch,
        "dtype": args.loop_dtype,
        "first_s": first,
        "kept_mib": kept,
        "images_per_s": rates,
        "ratio_resident_to_forward": ratio,
        "padded_rows": rows,
    }


SECTIONS = {
    "steps": section_steps,
    "augment": section_augment,
    "loop": section_loop,
    "eval": section_eval,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--arch", default="resnet50",
                        help="any backbone of sagm_jax.models.backbones")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per timing round")
    parser.add_argument("--loop_steps", type=int, default=300)
    parser.add_argument("--loop_dtype", default="bfloat16")
    parser.add_argument("--images_per_class", type=int, default=40)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    print(device_line(), flush=True)
    report = {"device": device_line(), "args": vars(args), "steps": {}, "augment": {}}
    for name in args.sections:
        try:
            SECTIONS[name](args, report)
        except Exception:  # a report goes on to its next section; the error is shown
            traceback.print_exc()
            report[f"{name}_error"] = traceback.format_exc()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
