"""Every backbone at full size trained on tiny images: SAGM, SAGM + MIRO + SWAD, a pack of 2.

    python experiments/run_every_backbone.py [--archs NAME ...] [--settings NAME ...]
        [--steps 3] [--out DIR]

RotatedDigits written as an RGB image folder (``sagm_jax.data.export``), read at 32x32
(DINOv2's ViT-B/14 at 28x28, two patches a side), random weights
(``pretrained_weights=none``), batch 4 per domain, test environment 0; each backbone
(``sagm_jax.models.backbones``, the published sizes) in each setting:

* ``sagm``: SAGM, the paper's update rule (``training.train.train_and_evaluate``);
* ``miro_swad``: SAGM + MIRO (its encoders on the backbone's five sown layers) + SWAD;
* ``pack2``: two SAGM runs (two seeds and learning rates) as one program
  (``training.packed.train_pack``).

One markdown row per run: wall seconds (compilation included), the last record's step,
loss and test-domain accuracy, and ``load_run``'s check (the run's model reloaded and
applied). Nothing here is a test: tests/training/test_backbone_runs.py trains
reduced-size variants of the same code in the suite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("resnet50", "clip_resnet50", "clip_vit-b16", "dinov2_vitb14", "swag_regnety_16gf")
SETTINGS = ("sagm", "miro_swad", "pack2")


def config_for(arch: str, folder: str, steps: int, **overrides):
    from sagm_jax.config import base_config

    config = base_config()
    config.update(dict(
        dataset="ImageFolder", data_dir=folder, arch=arch, pretrained_weights="none",
        image_size=28 if arch == "dinov2_vitb14" else 32, batch_per_env=4, eval_batch_size=64,
        test_envs=(0,), steps=steps, eval_every=steps - 1, algorithm="sagm", lr=3e-5,
        num_devices=1, freeze_batchnorm=False, checkpoint=True))
    config.update(overrides)
    return config


def run(arch: str, setting: str, folder: str, steps: int, scratch: str) -> str:
    import jax
    import jax.numpy as jnp

    from sagm_jax.training import loading, packed, train

    workdir = os.path.join(scratch, f"{arch}-{setting}")
    start = time.perf_counter()
    try:
        if setting == "pack2":
            configs = [config_for(arch, folder, steps, seed=s, lr=3e-5 * (1 + s)) for s in (0, 1)]
            dirs = [f"{workdir}-{s}" for s in (0, 1)]
            record = packed.train_pack(configs, dirs)[1][-1]
            workdir = dirs[1]
        else:
            extra = {} if setting == "sagm" else dict(
                objective="miro", swad=True, swad_eval_every=1, swad_n_converge=1,
                swad_n_tolerance=2, swad_tolerance_ratio=100.0, eval_every=1)
            record = train.train_and_evaluate(config_for(arch, folder, steps, **extra),
                                              workdir)[-1]
        wall = time.perf_counter() - start
        model, variables, _ = loading.load_run(workdir, "swad" if setting == "miro_swad"
                                               else "latest")
        size = 28 if arch == "dinov2_vitb14" else 32
        logits = model.apply(variables, jnp.zeros((2, size, size, 3)), train=False)
        reloaded = "ok" if logits.shape[0] == 2 and bool(jnp.isfinite(logits).all()) else "bad"
        jax.clear_caches()
    except Exception as error:  # a row for every run, the error in it
        traceback.print_exc()
        return f"| {arch} | {setting} | failed | {time.perf_counter() - start:.0f} | | | | {error} |"
    accuracy = record.get("env0_out_acc", float("nan"))
    return (f"| {arch} | {setting} | ok | {wall:.0f} | {record['step']} | {record['loss']:.3f} | "
            f"{accuracy:.3f} | {reloaded} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    args = parser.parse_args()
    import sagm_jax.cpu

    sagm_jax.cpu.configure()
    scratch = args.out or tempfile.mkdtemp(prefix="every_backbone_")
    folder = os.path.join(scratch, "rotated_digits_folder")
    if not os.path.isdir(folder):
        subprocess.run([sys.executable, "-m", "sagm_jax.data.export", "--dataset=RotatedDigits",
                        f"--out={folder}"], cwd=REPO, check=True, capture_output=True)
    print(f"{args.steps} steps a run; run directories under {scratch}")
    print("| backbone | setting | result | wall s | step | loss | test acc | load_run |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        for setting in args.settings:
            print(run(arch, setting, folder, args.steps, scratch), flush=True)


if __name__ == "__main__":
    main()
