"""Local sharpness curves (the paper's Figure 3) from the checkpoints of finished runs.

    python -m sagm_jax.sharpness_curves --input_dir sweeps/rotated_digits \
        --output_dir docs/data/study [--rhos 0,0.01,0.02,0.05,0.1,0.2] [--checkpoint latest]

For every finished run under ``input_dir`` (``rundir.find_runs``: ``done`` and ``config.json``)
and every checkpoint named (``--checkpoint latest,swad``: one curve each), the run's
parameters are restored (``sagm_jax.load_run``: latest, best, or a SWAD run's averaged
model) and ``sagm_jax.sharpness`` measures, on its TARGET domain ``D`` (every example of the
run's test environment, "in" and "out" splits together, no augmentation, eval mode)::

    h_rho = L_D(w + rho * g / ||g||) - L_D(w),    g = grad L_D(w)

Writes ``sharpness.json`` (one entry per run, target domain and checkpoint) and
``sharpness.png``: one panel per target domain, one curve per method (the tables' row
name, "+ SWAD" for a SWAD model, "(best)" for the selected checkpoint; mean over trial
seeds, bars = s.e.).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import sagm_jax.data
from sagm_jax.training import evaluation
from sagm_jax.training import loading
from sagm_jax.training import rundir
from sagm_jax.cli import quiet_tensorflow_import
from sagm_jax.methods.networks import MethodModel
from sagm_jax.methods.registry import method_label
from sagm_jax.results.sharpness import sharpness
from sagm_jax.training.train_step import apply_model, per_example_cross_entropy

DEFAULT_RHOS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)


def finished_runs(input_dir: str) -> list[str]:
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"--input_dir {input_dir!r} is not a directory.")
    runs = [
        run.path
        for run in rundir.find_runs(input_dir)
        if run.done and os.path.exists(os.path.join(run.path, rundir.CONFIG))
    ]
    if not runs:
        raise FileNotFoundError(
            f"No finished run (a 'done' file beside config.json) under {input_dir}."
        )
    return runs


def restore_run(workdir: str, checkpoint: str):
    """The run's config, dataset, model, variables and the step of its checkpoint
    (``loading.load_run``: the optimizer is not rebuilt, so per-device runs load too)."""
    config = ml_collections.ConfigDict(rundir.read_config(workdir))
    model, variables, record = loading.load_run(workdir, which=checkpoint)
    return config, sagm_jax.data.from_config(config), model, variables, record["step"]


class TargetDomain:
    """Every example of one environment, re-iterable (one pass per rho), each batch with
    ``key``, the evaluator's key of its draws (``evaluation.batch_key``: MTL's noise)."""

    def __init__(self, dataset, env: int, batch_size: int, seed: int = 0):
        self.dataset, self.env, self.batch_size, self.seed = dataset, env, batch_size, seed

    def __iter__(self):
        for part in self.dataset.splits[self.env]:
            batches = self.dataset.eval_iterator(self.env, part, batch_size=self.batch_size)
            for index, batch in enumerate(batches):
                yield {**batch, "key": evaluation.batch_key(self.seed, self.env, part, index)}


def _label(config, checkpoint: str) -> str:
    """The tables' row of the run (``methods.method_label``), "+ SWAD" for its SWAD model."""
    label = method_label(
        config.get("objective", "erm"), config.algorithm, config.get("disam_lambda", 0.0)
    )
    label += rundir.mixstyle_suffix(config)
    return label + (" + SWAD" if checkpoint == "swad" else "")


def run_sharpness(workdir: str, rhos, checkpoint: str = "latest") -> list[dict]:
    config, dataset, model, variables, step = restore_run(workdir, checkpoint)

    # A method's prediction (ARM, MTL) pools over the batch's real rows and draws from
    # the batch's key, as the evaluator's; its batch is the one the records name.
    pooled = isinstance(model, MethodModel)

    def loss_fn(params, batch):
        extra = {"mask": batch["mask"], "key": batch["key"]} if pooled else {}
        logits = apply_model(
            model, params, variables["batch_stats"], batch["image"], jnp.float32, **extra
        )
        losses = per_example_cross_entropy(logits, batch["label"])
        return jnp.sum(losses * batch["mask"]), jnp.sum(batch["mask"])

    size = evaluation.batch_size(config, 1, jax.default_backend(), model)
    entries = []
    for env in config.test_envs:
        result = sharpness(
            loss_fn, variables["params"], TargetDomain(dataset, env, size, config.seed), rhos
        )
        entries.append(
            {
                "run": os.path.relpath(workdir),
                "dataset": config.dataset,
                "algorithm": config.algorithm,
                "method": _label(config, checkpoint),
                "mixstyle": config.mixstyle,
                "eval_batch_size": size,
                "trial_seed": config.trial_seed,
                "test_env": int(env),
                "env_name": dataset.env_names[env],
                "checkpoint": checkpoint,
                "step": int(step),
                **result,
            }
        )
    return entries


def plot(entries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({(e["dataset"], e["test_env"], e["env_name"]) for e in entries})
    columns = min(3, len(domains))
    rows = -(-len(domains) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.3 * rows), squeeze=False)
    for ax, (dataset, env, name) in zip(axes.flat, domains):
        curves = collections.defaultdict(list)
        for e in entries:
            if (e["dataset"], e["test_env"]) == (dataset, env):
                label = e.get("method") or (
                    e["algorithm"].upper() + (" + MixStyle" if e["mixstyle"] else "")
                )
                label += " (best)" if e.get("checkpoint") == "best" else ""
                curves[label].append(e)
        for label in sorted(curves):
            rho = curves[label][0]["rho"]
            values = np.array([c["sharpness"] for c in curves[label]])
            mean, se = values.mean(0), values.std(0) / np.sqrt(len(values))
            ax.errorbar(
                rho,
                mean,
                yerr=se,
                marker="o",
                markersize=3,
                capsize=2,
                label=f"{label} (n={len(values)})",
            )
        ax.set_title(f"{dataset}: target {name} (env {env})", fontsize=9)
        ax.set_xlabel("rho")
        ax.set_ylabel("h_rho = L(w + rho g/|g|) - L(w)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(domains) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.sharpness_curves", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--input_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument(
        "--rhos", default=",".join(str(r) for r in DEFAULT_RHOS), help="comma-separated radii"
    )
    parser.add_argument(
        "--checkpoint",
        default="latest",
        help="which models of each run, comma-separated: latest, best (training-domain "
        "validation), swad (a SWAD run's averaged model); latest,swad draws both",
    )
    args = parser.parse_args(argv)
    quiet_tensorflow_import()  # its start-up notes, printed twice, are noise here
    try:
        rhos = [float(r) for r in args.rhos.split(",")]
    except ValueError:
        parser.error(f"--rhos {args.rhos!r}: expected comma-separated numbers.")
    checkpoints = args.checkpoint.split(",")
    if not set(checkpoints) <= {"latest", "best", "swad"}:
        parser.error(f"--checkpoint {args.checkpoint!r}: expected latest, best or swad, "
                     "comma-separated.")
    entries = []
    for workdir in finished_runs(args.input_dir):
        new_entries = [e for c in checkpoints for e in run_sharpness(workdir, rhos, c)]
        entries += new_entries
        for e in new_entries:
            curve = ", ".join(f"rho={r:g}: {h:.4g}" for r, h in zip(e["rho"], e["sharpness"]))
            print(
                f"{workdir} ({e['checkpoint']}): {e['algorithm']}, target env {e['test_env']} "
                f"({e['env_name']}), "
                f"h_rho = L(w + rho g/|g|) - L(w): {curve}"
            )
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "sharpness.json"), "w") as f:
        json.dump(entries, f, indent=1)
    plot(entries, os.path.join(args.output_dir, "sharpness.png"))
    print(f"Wrote {args.output_dir}/sharpness.json and sharpness.png ({len(entries)} curves).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
