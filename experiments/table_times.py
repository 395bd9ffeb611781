"""The time of one SAGM run per dataset, and of the paper's Table 1, from measured parts.

    python experiments/table_times.py [--eval_images_per_s 8600] [--step_ms 35.8]

Prints a Markdown table. Every input is a figure measured by one of this project's
benchmarks, named next to it below; every assumption that joins them is written next to
the arithmetic that makes it (``ASSUMPTIONS``). When a GPU session measures the
evaluation rate with inputs kept on the device (``device_report.py --sections eval``)
or a faster step, pass those figures and the table follows.

A run, in fast evaluation mode (``config.eval_splits="fast"``), with its stores built:

    start-up + compilation
    + steps x step time (batch 32 x training domains)
    + evaluations x (images each evaluation covers / evaluation images per second)
    + evaluations x checkpoint save

Images an evaluation covers with test domain ``t`` held out: the training domains'
'out' (20%) and all of ``t``: ``0.2 (N - N_t) + N_t``; the mean over the test
domains is ``0.2 N + 0.8 N / D`` (D domains), which needs no per-domain counts.
"""

from __future__ import annotations

import argparse

# (name, images N, domains D, steps, evaluations, per-domain counts or None, canvas)
# Sizes: sagm_jax.data.registry (the published totals); DomainNet's per-domain counts
# are the DomainNet paper's (clipart, infograph, painting, quickdraw, real, sketch; they
# sum to 586,575). Steps and evaluations: the configs (5,001 / 15,001 steps, an
# evaluation after update 0, every 100, and the last).
DATASETS = (
    ("PACS", 9_991, 4, 5_001, 51, (2048, 2344, 1670, 3929), "227x227"),
    ("VLCS", 10_729, 4, 5_001, 51, (1415, 2656, 3282, 3376), "capped"),
    ("OfficeHome", 15_588, 4, 5_001, 51, (2427, 4365, 4439, 4357), "capped"),
    ("TerraIncognita", 24_788, 4, 5_001, 51, None, "capped"),
    ("DomainNet", 586_575, 6, 15_001, 151, (48129, 51605, 72266, 172500, 172947, 69128), "capped"),
)
RUNS_IN_TABLE_1 = {"PACS": 12, "VLCS": 12, "OfficeHome": 12, "TerraIncognita": 12, "DomainNet": 18}

# Measured on one H100 (docs/data/device_report_h100.txt, 2026-11-23), bfloat16, ResNet-50:
STEP_MS = 1000 / 27.91  # the real loop's SAGM step at batch 96 (store -> device augmentation)
AUGMENT_EXTRA_MS = 2.69 - 2.12  # device augmentation of 320x427 canvases over 227x227
EVAL_IMAGES_PER_S = 1120 / 0.13  # an evaluation pass, batch 128, inputs from the host store
# One whole 300-step run's wall time (1 min 22 s) less its measured parts (store build
# 4.7 s, 300 steps at 27.91/s, 4 evaluations at 0.13 s): start-up and compilation.
STARTUP_S = 82 - 4.7 - 300 / 27.91 - 4 * 0.13
# Measured on the 2-core development machine's disk (docs/performance.md): a checkpoint
# save writes 200 MB in about 0.5 s; a ResNet-50 train state with Adam (parameters and
# two moments, float32) is 3 x 23.5 M x 4 bytes = 282 MB.
SAVE_S = 0.5 * 282 / 200
# Measured on the development CPU (docs/data/bench_decode_cpu.txt): the compressed store's
# decode per core with simplejpeg, training and evaluation inputs.
DECODE_PER_CORE = {"train": 2030, "eval": 4480}
CORES = 16

ASSUMPTIONS = (
    "the step time grows in proportion to the batch (measured at 96 = 32 x 3 domains only; "
    "DomainNet trains 32 x 5 = 160 a step)",
    "TerraIncognita, OfficeHome, VLCS and DomainNet images are stored at the capped size "
    "(shorter side 320): the augmentation costs the 320x427 canvas's extra "
    f"{AUGMENT_EXTRA_MS:.2f} ms a step",
    f"evaluation at the measured {EVAL_IMAGES_PER_S:,.0f} images/s (batch 128, inputs copied "
    "from the host at every evaluation, on the H100); kept on the device at batch 512, an "
    "H200 evaluated 9,708 images/s, 0.36 of its forward pass (docs/performance.md)",
    f"checkpoint saves at the development machine's disk rate ({SAVE_S:.1f} s each)",
    f"the H100 machine's {CORES} cores decode as fast as the development CPU's, so the "
    f"compressed store feeds {CORES * DECODE_PER_CORE['train']:,} training and "
    f"{CORES * DECODE_PER_CORE['eval']:,} evaluation images/s: more than the step and "
    "the evaluation take, so decoding adds only the first evaluation's reads",
    "stores already built (a first run on a machine builds them once)",
)


def run_seconds(n, domains, steps, evaluations, eval_images, canvas, step_ms, eval_rate):
    """Parts of one run, in seconds."""
    batch_domains = domains - 1
    step = step_ms * batch_domains / 3 + (AUGMENT_EXTRA_MS if canvas == "capped" else 0.0)
    # Only DomainNet's store is compressed (its decoded store is over store_budget_gb):
    # its first evaluation decodes the inputs it then keeps; a decoded store has them.
    compressed = n > 64 * 2**30 / (320 * 427 * 3 + 224 * 224 * 3)
    first_read = eval_images / (CORES * DECODE_PER_CORE["eval"]) if compressed else 0.0
    return {
        "start-up": STARTUP_S,
        "training": steps * step / 1000,
        "evaluation": evaluations * eval_images / eval_rate + first_read,
        "checkpoints": evaluations * SAVE_S,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval_images_per_s", type=float, default=EVAL_IMAGES_PER_S)
    parser.add_argument("--step_ms", type=float, default=STEP_MS, help="SAGM step at batch 96")
    args = parser.parse_args()
    print(
        f"One H100, bfloat16, SAGM on ResNet-50, fast evaluation; step {args.step_ms:.1f} ms "
        f"at batch 96, evaluation {args.eval_images_per_s:,.0f} images/s.\n"
    )
    print("| dataset | images an evaluation covers (range over test domains) | start-up | "
          "training | evaluation | checkpoints | run | Table 1 runs | Table 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = 0.0
    for name, n, domains, steps, evaluations, counts, canvas in DATASETS:
        mean = 0.2 * n + 0.8 * n / domains
        parts = run_seconds(
            n, domains, steps, evaluations, mean, canvas, args.step_ms, args.eval_images_per_s
        )
        seconds = sum(parts.values())
        table = RUNS_IN_TABLE_1[name] * seconds
        total += table
        covered = f"{mean:,.0f} ({mean / n:.0%})"
        if counts:
            low, high = (0.2 * (n - c) + c for c in (min(counts), max(counts)))
            covered += f"; {low:,.0f}-{high:,.0f} ({low / n:.0%}-{high / n:.0%})"
        print(
            f"| {name} | {covered} | {parts['start-up']:.0f} s | {parts['training'] / 60:.1f} min "
            f"| {parts['evaluation'] / 60:.1f} min | {parts['checkpoints']:.0f} s "
            f"| **{seconds / 60:.1f} min** | {RUNS_IN_TABLE_1[name]} | {table / 3600:.1f} h |"
        )
    print(f"\nTable 1's {sum(RUNS_IN_TABLE_1.values())} SAGM runs: {total / 3600:.1f} H100-hours.")
    print("\nAssumptions:")
    for line in ASSUMPTIONS:
        print(f"- {line}")


if __name__ == "__main__":
    main()
