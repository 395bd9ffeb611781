"""Every registered method trained from the command line, as a researcher starts it.

    python experiments/run_every_method.py [--methods NAME ...] [--settings NAME ...]
        [--steps 21] [--set KEY=VALUE ...] [--out DIR]

For each method (an objective with ``algorithm=erm``, or an update rule with
``objective=erm``, as the registries list them) and each setting, it runs
``python -m sagm_jax.main`` in a fresh process and prints a markdown row: the exit
status, the wall time of the process, the last record's step, loss and test accuracy.
The settings:

* ``digits``: ``configs/rotated_digits.py`` on one device;
* ``digits8``: the same on 8 fake CPU devices (``--xla_force_host_platform_device_count=8``;
  the batch is sharded over them);
* ``folder``: ``configs/image_folder.py`` on RotatedDigits written as an RGB image folder
  (``sagm_jax.data.export``), ResNet-18 from scratch, 32x32 inputs, batch 8 per domain;
  BatchNorm trained, but frozen for the procedures (which refuse trainable BatchNorm);
* ``sagm`` and ``swad``: an objective under the SAGM update rule, and under Adam with
  SWAD (objectives only: the procedures make their own update).

``--set KEY=VALUE`` adds ``--config.KEY=VALUE`` to every run that trains the method owning
KEY (short anneals, e.g. ``--set trm_iters=5 rdm_penalty_anneal_iters=5``, so that a
21-step run reaches a method's second phase). A run that fails prints its last error
line in the table. Nothing here is a test: the
tests train each method on tiny data (``tests/methods/``); this is the whole program,
start-up included, on the offline dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ("digits", "digits8", "folder", "sagm", "swad")
FOLDER_FLAGS = ["--config.arch=resnet18", "--config.pretrained_weights=none",
                "--config.image_size=32",
                "--config.batch_per_env=8", "--config.eval_batch_size=64",
                "--config.test_envs=0"]


def every_method() -> list[tuple[str, str]]:
    """(objective, update rule) of every registered method but ERM."""
    from sagm_jax.methods.registry import OBJECTIVES, UPDATE_RULES

    pairs = [(objective, "erm") for objective in OBJECTIVES if objective != "erm"]
    return pairs + [("erm", rule) for rule in UPDATE_RULES if rule != "erm"]


def command(objective: str, rule: str, setting: str, steps: int, folder: str, workdir: str,
            overrides=()):
    """(argv, extra environment) of one run, or None where the setting does not apply;
    ``overrides`` are ``KEY=VALUE`` words, each given where the method declares KEY."""
    from sagm_jax.methods.registry import OBJECTIVES, UPDATE_RULES
    if setting in ("sagm", "swad") and objective == "erm":
        return None
    config = "image_folder.py" if setting == "folder" else "rotated_digits.py"
    argv = [sys.executable, "-m", "sagm_jax.main", f"--config=configs/{config}",
            f"--workdir={workdir}", f"--config.objective={objective}",
            f"--config.algorithm={'sagm' if setting == 'sagm' else rule}",
            f"--config.steps={steps}", f"--config.eval_every={steps - 1}"]
    own = {h.key for entry in (OBJECTIVES[objective], UPDATE_RULES[rule])
           for h in entry.method.hyperparameters}
    argv += [f"--config.{word}" for word in overrides if word.split("=")[0] in own]
    env = {}
    if setting == "folder":
        from sagm_jax.methods.registry import rule_names

        procedure = rule in rule_names("procedure")
        argv += [f"--config.data_dir={folder}", *FOLDER_FLAGS,
                 f"--config.freeze_batchnorm={procedure}"]
    if setting == "swad":
        argv += ["--config.swad=True", "--config.swad_n_converge=1",
                 "--config.swad_n_tolerance=2", "--config.swad_tolerance_ratio=0.3"]
    if setting == "digits8":
        env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                            + " --xla_force_host_platform_device_count=8").strip()
    return argv, env


def last_record(workdir: str) -> dict:
    for root, _, files in os.walk(workdir):
        if "results.jsonl" in files:
            with open(os.path.join(root, "results.jsonl")) as f:
                lines = [line for line in f if line.strip()]
            return json.loads(lines[-1]) if lines else {}
    return {}


def run(objective, rule, setting, steps, folder, scratch, overrides=()) -> str:
    name = rule if objective == "erm" else objective
    workdir = os.path.join(scratch, f"{name}-{setting}")
    built = command(objective, rule, setting, steps, folder, workdir, overrides)
    if built is None:
        return ""
    argv, env = built
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        error = (done.stderr.strip().splitlines() or ["?"])[-1][:120]
        return f"| {name} | {setting} | exit {done.returncode} | {wall:.0f} | | | {error} |"
    record = last_record(workdir)
    accuracy = [v for k, v in record.items() if k.endswith("_out_acc")]
    test = record.get("test_out_acc", accuracy[0] if accuracy else float("nan"))
    return (f"| {name} | {setting} | 0 | {wall:.0f} | {record.get('step')} "
            f"| {record.get('loss', float('nan')):.3f} | {test:.3f} |")


def main():
    pairs = every_method()
    names = [rule if objective == "erm" else objective for objective, rule in pairs]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="*", default=names, choices=names)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="a method hyperparameter for the runs of the methods that have it")
    parser.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    args = parser.parse_args()
    scratch = args.out or tempfile.mkdtemp(prefix="every_method_")
    folder = os.path.join(scratch, "rotated_digits_folder")
    if "folder" in args.settings and not os.path.isdir(folder):
        subprocess.run([sys.executable, "-m", "sagm_jax.data.export", "--dataset=RotatedDigits",
                        f"--out={folder}"], cwd=REPO, check=True, capture_output=True)
    print(f"{args.steps} steps a run; run directories under {scratch}")
    print("| method | setting | exit | wall s | step | loss | test acc / error |")
    print("|---|---|---|---|---|---|---|")
    for (objective, rule), name in zip(pairs, names):
        if name not in args.methods:
            continue
        for setting in args.settings:
            row = run(objective, rule, setting, args.steps, folder, scratch, args.set)
            if row:
                print(row, flush=True)


if __name__ == "__main__":
    main()
