"""The training program: one run (or one per test environment) from a config.

``run`` reads as the loop it is: check the config and the run directory, set up (data,
model, optimizer, steps, evaluator; nothing is written until all of it succeeded),
restore, then step, log, evaluate, record, save. The parts live in their own modules:

  rundir        config.json, run_info.json, split.json, results.jsonl, done
  checkpoints   one orbax manager keeping the latest and the best checkpoint
  evaluation    the evaluator: ``env{i}_{part}_acc`` of a state
  train_step    the step, and the one place that decides the data-parallel mode

Steps follow DomainBed: update ``t = 0 .. steps-1``; after update ``t`` the run
evaluates when ``t % eval_every == 0`` or ``t == steps - 1`` and appends a record
with ``step = t``, ``loss`` = the mean training loss since the last record, and
``env{i}_{part}_acc`` for every environment and split part. The record is written
(and flushed) BEFORE the checkpoint of that step (``checkpoints/<t>``), so after a
kill at any point the restart restores the newest checkpoint (state ``step = s + 1``),
drops records with ``step > s`` and repeats exactly what was lost: batches, dropout
masks and augmentations are functions of ``(seed, step)``.

``load_run(workdir, which)`` gives a finished run's model, variables and record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from sagm_jax import data as data_lib
from sagm_jax import models
from sagm_jax.checkpoints import Checkpoints, restore_variables, saved_steps
from sagm_jax.config import validate
from sagm_jax.data.pipeline import prefetch_to_mesh
from sagm_jax.evaluation import Evaluator, validation_accuracy
from sagm_jax.optimizers import optimizer_from_config
from sagm_jax.rundir import CONFIG, DONE, RESULTS, RUN_INFO, RunDir, read_records
from sagm_jax.selection import training_domain_validation
from sagm_jax.train_step import build_train_step, create_train_state

__all__ = ["DONE", "RESULTS", "load_run", "read_records", "run", "train_and_evaluate"]


@dataclasses.dataclass
class Program:
    """Everything a run needs, built by :func:`setup` before anything is written."""

    dataset: Any
    test_envs: list[int]
    train_envs: list[int]
    mesh: jax.sharding.Mesh
    model: Any
    state: Any  # the initial TrainState, replicated on the mesh
    train_step: Any
    evaluator: Evaluator
    run_info: dict


def _environments(config, dataset) -> tuple[list[int], list[int]]:
    n_envs = len(dataset.env_names)
    test_envs = [int(e) for e in config.test_envs]
    if any(not 0 <= e < n_envs for e in test_envs):
        raise ValueError(
            f"config.test_envs={tuple(config.test_envs)}: expected indices in "
            f"0..{n_envs - 1} of {config.dataset}'s environments {dataset.env_names}."
        )
    train_envs = [e for e in range(n_envs) if e not in test_envs]
    if not train_envs:
        raise ValueError(
            f"config.test_envs={tuple(config.test_envs)} leaves no training environment."
        )
    return test_envs, train_envs


def _mesh(config, train_envs) -> jax.sharding.Mesh:
    devices = jax.devices()[: config.num_devices or None]
    for key, size in (
        ("batch_per_env * len(train_envs)", config.batch_per_env * len(train_envs)),
        ("eval_batch_size", config.eval_batch_size),
    ):
        if size % len(devices):
            raise ValueError(
                f"config.{key} = {size} does not divide among {len(devices)} devices; "
                "choose config.batch_per_env / config.eval_batch_size, or "
                "config.num_devices, so that it does."
            )
    return jax.sharding.Mesh(np.array(devices), ("batch",))


def setup(config: ml_collections.ConfigDict) -> Program:
    """Opens the data, builds the model, optimizer, steps and evaluator: every check
    that can fail runs here, before the run directory is written."""
    dataset = data_lib.from_config(config)
    test_envs, train_envs = _environments(config, dataset)
    mesh = _mesh(config, train_envs)
    init_key = jax.random.split(jax.random.key(config.seed))[0]
    model, variables, weights = models.from_config(
        config, dataset.num_classes, dataset.input_shape, init_key
    )
    optimizer = optimizer_from_config(config, axis_name="batch")
    state = jax.device_put(create_train_state(variables, optimizer), NamedSharding(mesh, P()))
    run_info = {
        "weights": weights,
        "dataset": config.dataset,
        "env_names": dataset.env_names,
        "num_classes": dataset.num_classes,
        "input_shape": list(dataset.input_shape),
        "fingerprint": dataset.fingerprint,
        "train_envs": train_envs,
        "test_envs": test_envs,
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    return Program(
        dataset=dataset,
        test_envs=test_envs,
        train_envs=train_envs,
        mesh=mesh,
        model=model,
        state=state,
        train_step=build_train_step(config, model, optimizer, mesh),
        evaluator=Evaluator(model, dataset, mesh, config, train_envs),
        run_info=run_info,
    )


def run(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    """Trains one run with ``config.test_envs`` held out; returns its records."""
    validate(config, device_count=jax.device_count())
    rundir = RunDir(workdir, is_main=jax.process_index() == 0)
    config_dict = config.to_dict()
    rundir.check_config(config_dict)  # first, finished run or not
    if rundir.done:
        return _finished(rundir, config)
    program = setup(config)
    rundir.start(config_dict, program.run_info, program.dataset)
    if rundir.is_main and program.dataset.skipped:
        print(f"Skipped {len(program.dataset.skipped)} unreadable files (listed in split.json).")
    checkpoints = Checkpoints(workdir, enabled=config.checkpoint)
    state = checkpoints.restore_latest(program.state)
    if state is None:
        state = program.state
    else:
        print(f"{workdir}: resumed at step {int(state.step)}.")
    records = rundir.records_before(int(state.step))
    records += _train(config, program, rundir, checkpoints, state)
    rundir.mark_done()
    if rundir.is_main:
        print_summary(records, program.test_envs, program.dataset.env_names)
    return records


def _finished(rundir: RunDir, config) -> list[dict]:
    records = read_records(rundir.workdir)
    if rundir.is_main:
        with open(os.path.join(rundir.workdir, RUN_INFO)) as f:
            env_names = json.load(f)["env_names"]
        print(f"{rundir.workdir}: already done; not training again.")
        print_summary(records, list(config.test_envs), env_names)
    return records


def _train(config, program: Program, rundir: RunDir, checkpoints: Checkpoints, state):
    """Steps from ``state.step`` to ``config.steps``; returns the new records."""
    start, records = int(state.step), []
    step_key = jax.random.split(jax.random.key(config.seed))[1]
    writer = _metric_writer(rundir.workdir, rundir.is_main)
    batches = prefetch_to_mesh(
        program.dataset.train_iterator(
            program.train_envs,
            seed=config.seed,
            batch_per_env=config.batch_per_env,
            start_step=start,
        ),
        program.mesh,
    )
    loss_sum, loss_count = jnp.zeros([], jnp.float32), 0
    progress = tqdm(
        total=config.steps,
        initial=start,
        unit="step",
        disable=not rundir.is_main,
        dynamic_ncols=True,
    )
    try:
        for t in range(start, config.steps):
            state, metrics = program.train_step(state, next(batches), step_key)
            loss_sum, loss_count = loss_sum + metrics["loss"], loss_count + 1
            progress.update(1)
            if t % config.log_every == 0:
                loss = _finite_loss(float(metrics["loss"]), t, checkpoints, rundir)
                progress.set_postfix(loss=f"{loss:.4f}")
                writer.write_scalars(t, {"train/loss": loss})
            if t % config.eval_every == 0 or t == config.steps - 1:
                mean_loss = _finite_loss(float(loss_sum) / loss_count, t, checkpoints, rundir)
                if not _all_finite(state.params):
                    _stop_non_finite(rundir.workdir, t, mean_loss, checkpoints)
                accuracies = program.evaluator(state)
                record = _record(config, program, rundir.workdir, t, mean_loss, accuracies)
                rundir.append(record)  # before the checkpoint: see the module docstring
                records.append(record)
                writer.write_scalars(t, {k: v for k, v in record.items() if k.endswith("_acc")})
                checkpoints.save(t, state, validation_accuracy(record, program.train_envs))
                loss_sum, loss_count = jnp.zeros([], jnp.float32), 0
    finally:  # a pending asynchronous save completes even when the loop fails
        batches.close()  # stops the prefetching thread
        progress.close()
        checkpoints.wait()
    writer.flush()
    return records


def _record(config, program: Program, workdir: str, step: int, loss: float, accuracies) -> dict:
    """The DomainBed-compatible record of evaluation ``step``."""
    config_dict = config.to_dict()
    smallest_env = min(len(program.dataset.splits[e]["in"]) for e in program.train_envs)
    setting = {k: v for k, v in config_dict.items() if k not in NOT_HPARAMS}
    return {
        "step": step,
        "loss": loss,
        "epoch": (step + 1) * config.batch_per_env / smallest_env,
        **accuracies,
        "args": {
            "dataset": config.dataset,
            "algorithm": config.algorithm,
            "test_envs": program.test_envs,
            "trial_seed": config.trial_seed,
            "seed": config.seed,
            "hparams_seed": hparams_seed(config_dict),
            "output_dir": os.path.abspath(workdir),
        },
        "hparams": setting,
        "config": config_dict,
    }


def _all_finite(tree) -> bool:
    return bool(jax.tree.reduce(lambda a, x: a & jnp.all(jnp.isfinite(x)), tree, jnp.array(True)))


def _finite_loss(loss: float, step: int, checkpoints, rundir) -> float:
    if not np.isfinite(loss):
        _stop_non_finite(rundir.workdir, step, loss, checkpoints)
    return loss


def _stop_non_finite(workdir, step, loss, checkpoints: Checkpoints):
    checkpoints.wait()
    latest = checkpoints.latest_step()
    kept = (
        "no checkpoint yet"
        if latest is None
        else f"the last good checkpoint, step {latest}, is kept in "
        f"{os.path.join(workdir, 'checkpoints', str(latest))}"
    )
    raise FloatingPointError(
        f"Non-finite training loss ({loss}) or parameters at step {step}; stopping. {kept}. "
        "Lower config.lr, or check the data."
    )


def load_run(workdir: str, which: str | int = "best"):
    """A trained run, for inference or analysis: ``(model, variables, record)``.

    ``which``: ``"best"`` (the step training-domain validation selects, as the summary
    and the tables do), ``"latest"``, or a step number of a kept checkpoint. ``model``
    is the Flax module, ``variables`` its ``{'params', 'batch_stats'}``; apply it as
    ``model.apply(variables, images_nhwc, train=False)`` to images prepared as the run's
    evaluation prepares them. ``record`` is the results.jsonl record of that step.
    Nothing of the optimizer is rebuilt, so any run (any algorithm, per-device
    perturbation included) loads the same way.
    """
    with open(os.path.join(workdir, CONFIG)) as f:
        config = ml_collections.ConfigDict(json.load(f))
    with open(os.path.join(workdir, RUN_INFO)) as f:
        info = json.load(f)
    records = read_records(workdir)
    if which == "best":
        step = training_domain_validation(records, config.test_envs)["step"]
    elif which == "latest":
        step = max(saved_steps(workdir), default=None)
    else:
        step = int(which)
    if step is None:
        raise FileNotFoundError(f"{workdir} holds no checkpoint.")
    model = models.from_config(
        config, info["num_classes"], info["input_shape"], jax.random.key(0), pretrained=False
    )[0]
    record = next((r for r in records if r["step"] == step), None)
    return model, restore_variables(workdir, step), record


class _NoTensorBoard:
    """Stands in for clu's writer where TensorFlow (which clu's writer needs) is not
    installed: results.jsonl and the progress bar carry the same numbers."""

    def write_scalars(self, step, scalars):
        del step, scalars

    def flush(self):
        pass


def _metric_writer(workdir: str, is_main: bool):
    try:
        from sagm_jax.data import tf_input  # noqa: F401  keeps TensorFlow off accelerators
    except ImportError:
        if is_main:
            print("TensorFlow is not installed: no TensorBoard scalars (results.jsonl has them).")
        return _NoTensorBoard()
    from clu import metric_writers

    return metric_writers.create_default_writer(workdir, just_logging=not is_main)


def print_summary(records: list[dict], test_envs, env_names=None) -> None:
    """The step chosen by training-domain validation and its accuracy (%) per environment
    and split part, as the result tables show accuracies."""
    if not records:
        print("No evaluation records.")
        return
    chosen = training_domain_validation(records, test_envs)
    envs = sorted({int(k[3:].split("_")[0]) for k in chosen if k.startswith("env")})
    parts = [p for p in ("in", "out", "test") if f"env{envs[0]}_{p}_acc" in chosen]
    names = {e: f"env{e}" + (f" {env_names[e]}" if env_names else "") for e in envs}
    width = max(len(n) for n in names.values()) + 8
    print(
        f"Selected step {chosen['step']} by training-domain validation (mean 'out' accuracy "
        f"of the training environments {100 * chosen['validation_acc']:.1f}%):"
    )
    print("  " + "environment".ljust(width) + "".join(f"{p + ' %':>8}" for p in parts))
    for e in envs:
        label = f"{names[e]} ({'test' if e in test_envs else 'train'})"
        values = "".join(f"{100 * chosen[f'env{e}_{p}_acc']:>8.1f}" for p in parts)
        print("  " + label.ljust(width) + values)
    tests = ", ".join(f"{names[e]} {100 * chosen[f'env{e}_in_acc']:.1f}%" for e in test_envs)
    print(f"Test accuracy ('in' split of the test environment): {tests}")


# Config keys that differ between the runs of one hyperparameter setting.
NOT_HPARAMS = ("test_envs", "all_test_envs", "trial_seed", "seed")


def hparams_seed(config_dict: dict) -> int:
    """DomainBed's ``args.hparams_seed`` for a run: an integer naming its hyperparameter
    setting, the md5 of its config without :data:`NOT_HPARAMS`, reduced to 31 bits as
    DomainBed's ``seed_hash``. The runs of one setting share it across test environments
    and trial seeds (DomainBed's collector groups a sweep's runs by it, and matches
    leave-one-domain-out pairs through it); any other config difference gives another."""
    import hashlib

    setting = {k: v for k, v in config_dict.items() if k not in NOT_HPARAMS}
    text = json.dumps(setting, sort_keys=True, default=str)
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16) % 2**31


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{s:02d}s" if hours else f"{minutes}m{s:02d}s"


def _test_accuracy_table(config, env_names, accuracies: dict) -> str:
    """The markdown table of one test accuracy per environment and their average."""
    average = 100 * np.mean(list(accuracies.values()))
    return "\n".join(
        [
            f"{config.dataset} / {config.algorithm}, test accuracy (training-domain "
            f"validation), % (the 'in' split of each test environment):",
            "",
            "| " + " | ".join(["test environment", *env_names, "Avg"]) + " |",
            "|---|" + ":-:|" * (len(env_names) + 1),
            "| accuracy | "
            + " | ".join(f"{100 * a:.1f}" for a in accuracies.values())
            + f" | {average:.1f} |",
        ]
    )


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> Any:
    """Runs ``config.test_envs``, or every environment in turn with ``config.all_test_envs``
    (then prints the table of test accuracies and writes it to ``workdir/results.md``).
    Ends with the run directory and the wall time."""
    import time

    start, is_main = time.monotonic(), jax.process_index() == 0
    if is_main:
        print(f"Run directory: {os.path.abspath(workdir)}", flush=True)
    if not config.all_test_envs:
        result = run(config, workdir)
    else:
        env_names = data_lib.from_config(config, open_images=False).env_names
        result = {}
        for env in range(len(env_names)):
            env_config = ml_collections.ConfigDict(config.to_dict())
            env_config.test_envs, env_config.all_test_envs = (env,), False
            records = run(env_config, os.path.join(workdir, f"test_env{env}"))
            result[env] = training_domain_validation(records, [env])[f"env{env}_in_acc"]
        table = _test_accuracy_table(config, env_names, result)
        if is_main:
            with open(os.path.join(workdir, "results.md"), "w") as f:
                f.write(table + "\n")
            print("\n" + table + f"\n(written to {os.path.join(workdir, 'results.md')})")
    if is_main:
        print(f"Run directory: {os.path.abspath(workdir)}")
        print(f"Wall time: {_duration(time.monotonic() - start)}")
    return result
