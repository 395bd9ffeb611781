"""One training run (or one per test environment): data, model, loop, evaluation, records.

Run directory (``workdir``)::

    config.json      the run's config
    run_info.json    weights file and SHA-256, dataset fingerprint, devices, versions
    split.json       split indices, file lists and dataset fingerprint (sagm_jax.data)
    results.jsonl    one DomainBed-compatible record per evaluation
    checkpoints/     orbax: latest/ (newest evaluation) and best/ (training-domain validation)
    events.out.*     TensorBoard scalars (clu)
    done             written last; a finished run is never trained again

Steps follow DomainBed: update ``t = 0 .. steps-1``; after update ``t`` the run
evaluates when ``t % eval_every == 0`` or ``t == steps - 1`` and appends a record
with ``step = t``, ``loss`` = the mean training loss since the last record, and
``env{i}_{part}_acc`` for every environment and split part. The record is written
(and flushed) BEFORE the checkpoint of that step, so after a kill at any point
the restart restores the newest checkpoint (state ``step = s``), drops records
with ``step >= s`` and repeats exactly what was lost: batches, dropout masks and
augmentations are functions of ``(seed, step)``.
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from sagm_jax import data as data_lib
from sagm_jax import models
from sagm_jax.data import device_augment
from sagm_jax.data.pipeline import prefetch_to_mesh
from sagm_jax.config import validate
from sagm_jax.optimizers import paper_optimizer
from sagm_jax.selection import training_domain_validation
from sagm_jax.train_step import create_train_state, make_train_step

RESULTS = "results.jsonl"
DONE = "done"


def optimizer_from_config(config: ml_collections.ConfigDict, axis_name=None):
    """The one place that turns a config into the optimizer."""
    return paper_optimizer(
        config.algorithm,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        rho=config.rho,
        alpha=config.alpha,
        combine=config.combine,
        adaptive=config.adaptive,
        perturbation=config.perturbation,
        axis_name=axis_name if config.perturbation == "per_device" else None,
    )


def dataset_from_config(config: ml_collections.ConfigDict, *, open_images: bool = True):
    """The run's dataset, opened and split as the config says. An image folder with
    ``config.input='device'`` is served from its decoded store (built on first use;
    ``open_images=False`` skips that, for callers that only need the split)."""
    cache_dir = config.cache_dir or None
    dataset = data_lib.load(
        config.dataset,
        config.data_dir or None,
        trial_seed=config.trial_seed,
        holdout_fraction=config.holdout_fraction,
        split=config.split,
        skip_bad_files=config.skip_bad_files,
        data_seed=config.seed,
        image_size=config.image_size,
        **({"cache_dir": os.path.join(cache_dir, "verified")} if cache_dir else {}),
    )
    if open_images and dataset.folder is not None and config.input == "device":
        from sagm_jax.data import store

        dataset.attach_source(
            store.open_source(
                dataset.folder,
                image_size=config.image_size,
                short_side=config.store_short_side,
                mode=config.image_store,
                budget_gb=config.store_budget_gb,
                cache_dir=cache_dir,
                progress=jax.process_index() == 0,
            )
        )
    return dataset


def model_from_config(config, dataset, key, pretrained: bool = True):
    """The network and its variables, with the pretrained backbone of
    ``config.pretrained_weights`` unless ``pretrained=False`` (the caller restores
    a checkpoint instead). Returns ``(model, variables, weights_info)``."""
    model = models.create(
        config.arch,
        dataset.num_classes,
        dropout_rate=config.dropout,
        freeze_batchnorm=config.freeze_batchnorm,
        mixstyle_after=tuple(config.mixstyle_after) if config.mixstyle else (),
        input_channels=dataset.input_shape[-1],
        cnn_widths=tuple(config.cnn_widths),
    )
    sample = jnp.zeros((1, *dataset.input_shape), jnp.float32)
    variables = model.init(key, sample, train=False)
    weights = {"file": None, "sha256": None}
    if pretrained and config.pretrained_weights and config.pretrained_weights.lower() != "none":
        state_dict, sha256 = models.load_weights(config.pretrained_weights)
        converted = models.convert_torchvision(state_dict, arch=config.arch)
        variables = models.with_pretrained_backbone(variables, converted)
        weights = {"file": os.path.abspath(config.pretrained_weights), "sha256": sha256}
    return model, variables, weights


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def read_records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, RESULTS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _keep_records_before(workdir: str, step: int) -> list[dict]:
    """Rewrites results.jsonl without records of steps a restored state has not done."""
    records = [r for r in read_records(workdir) if r["step"] < step]
    path = os.path.join(workdir, RESULTS)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    os.replace(tmp, path)
    return records


def _append_record(workdir: str, record: dict) -> None:
    with open(os.path.join(workdir, RESULTS), "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _check_same_config(workdir: str, config_dict: dict) -> None:
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        previous = json.load(f)
    current = json.loads(json.dumps(config_dict, default=str))
    changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
    if changed:
        raise ValueError(
            f"{path} holds a run with a different config (keys {changed} differ); resuming it "
            "would mix two runs. Use another --workdir, or delete that directory."
        )


def make_steps(config, model, optimizer, mesh):
    """The run's jitted ``train_step(state, batch, key)`` and ``eval_step(params,
    batch_stats, batch)``. The data-parallel mode is decided here: 'global' is one
    jitted program over the sharded batch; 'per_device' (m-sharpness) runs the step
    per device under ``shard_map``. Both start with ``device_augment.model_inputs``,
    which augments uint8 image-folder batches on the device."""
    compute_dtype = jnp.dtype(config.compute_dtype)
    step_fn = make_train_step(
        model,
        optimizer,
        algorithm=config.algorithm,
        use_mixstyle=config.mixstyle,
        train_batchnorm=not config.freeze_batchnorm,
        shared_dropout=config.shared_dropout,
        compute_dtype=compute_dtype,
        axis_name="batch" if config.perturbation == "per_device" else None,
    )
    if config.perturbation == "per_device":
        # m-sharpness: each device differentiates its own shard (check_vma=False keeps
        # gradients of replicated parameters local, as under pmap).
        step_fn = jax.shard_map(
            step_fn,
            mesh=mesh,
            in_specs=(P(), P("batch"), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )

    def train_step(state, batch, key):
        batch = device_augment.model_inputs(batch, config.seed, state.step, config.image_size)
        return step_fn(state, batch, key)

    eval_step = make_eval_step(model, compute_dtype, config.seed, config.image_size)
    return jax.jit(train_step, donate_argnums=0), eval_step


def make_eval_step(model, compute_dtype, seed: int = 0, image_size: int = 224):
    def eval_step(params, batch_stats, batch):
        batch = device_augment.model_inputs(
            batch, seed, 0, image_size, stream=device_augment.EVAL_STREAM
        )
        variables = {"params": jax.tree.map(lambda p: p.astype(compute_dtype), params)}
        if batch_stats:
            variables["batch_stats"] = batch_stats
        logits = model.apply(variables, batch["image"].astype(compute_dtype), train=False)
        correct = (jnp.argmax(logits, -1) == batch["label"]) & batch["mask"]
        return jnp.sum(correct), jnp.sum(batch["mask"])

    return jax.jit(eval_step)


def evaluate(eval_step, state, dataset, mesh, config, train_envs) -> dict:
    """``env{i}_{part}_acc`` over every example of every split part of every environment."""
    accuracies = {}
    for env in range(len(dataset.env_names)):
        for part in dataset.splits[env]:
            augment = config.augment_validation and part == "out" and env in train_envs
            batches = dataset.eval_iterator(
                env,
                part,
                batch_size=config.eval_batch_size,
                augment=augment,
                seed=config.seed,
                batch_multiple=mesh.devices.size,
            )
            counts = [
                eval_step(state.params, state.batch_stats, batch)
                for batch in prefetch_to_mesh(batches, mesh)
            ]
            correct = sum(int(c) for c, _ in counts)
            total = sum(int(n) for _, n in counts)
            accuracies[f"env{env}_{part}_acc"] = correct / total if total else float("nan")
    return accuracies


def _checkpoint_managers(workdir: str):
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    latest = ocp.CheckpointManager(
        os.path.join(directory, "latest"),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
    )
    best = ocp.CheckpointManager(
        os.path.join(directory, "best"),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
    )
    return latest, best


def _all_finite(tree) -> bool:
    return bool(jax.tree.reduce(lambda a, x: a & jnp.all(jnp.isfinite(x)), tree, jnp.array(True)))


def run(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    """Trains one run with ``config.test_envs`` held out; returns its records."""
    validate(config)
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(os.path.join(workdir, DONE)):
        records = read_records(workdir)
        print(f"{workdir}: already done; not training again.")
        print_summary(records, list(config.test_envs))
        return records

    dataset = dataset_from_config(config)
    n_envs = len(dataset.env_names)
    test_envs = [int(e) for e in config.test_envs]
    if not test_envs or any(not 0 <= e < n_envs for e in test_envs):
        raise ValueError(
            f"config.test_envs={tuple(config.test_envs)}: expected indices in "
            f"0..{n_envs - 1} of {config.dataset}'s environments {dataset.env_names}."
        )
    train_envs = [e for e in range(n_envs) if e not in test_envs]
    if not train_envs:
        raise ValueError(
            f"config.test_envs={tuple(config.test_envs)} leaves no training environment."
        )

    config_dict = config.to_dict()
    if is_main:
        _check_same_config(workdir, config_dict)
        _write_json(os.path.join(workdir, "config.json"), config_dict)
        dataset.write_split(workdir)
        if dataset.skipped:
            print(f"Skipped {len(dataset.skipped)} unreadable files (listed in split.json).")

    init_key, step_key = jax.random.split(jax.random.key(config.seed))
    model, variables, weights = model_from_config(config, dataset, init_key)
    if is_main:
        _write_json(
            os.path.join(workdir, "run_info.json"),
            {
                "weights": weights,
                "dataset": config.dataset,
                "env_names": dataset.env_names,
                "fingerprint": dataset.fingerprint,
                "train_envs": train_envs,
                "test_envs": test_envs,
                "devices": [str(d) for d in jax.devices()],
                "process_count": jax.process_count(),
                "jax": jax.__version__,
                "python": platform.python_version(),
            },
        )

    devices = jax.devices()[: config.num_devices or None]
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
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
    replicated = NamedSharding(mesh, P())
    optimizer = optimizer_from_config(config, axis_name="batch")
    train_step, eval_step = make_steps(config, model, optimizer, mesh)
    state = jax.device_put(create_train_state(variables, optimizer), replicated)

    latest, best = _checkpoint_managers(workdir) if config.checkpoint else (None, None)
    records = []
    if latest is not None and latest.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = latest.restore(latest.latest_step(), args=ocp.args.StandardRestore(abstract))
        records = _keep_records_before(workdir, int(state.step)) if is_main else []
        print(f"{workdir}: resumed at step {int(state.step)}.")
    elif is_main:
        _keep_records_before(workdir, 0)
    start = int(state.step)
    best_validation = max((_validation(r, train_envs) for r in records), default=-1.0)

    writer = _metric_writer(workdir, is_main)
    batches = prefetch_to_mesh(
        dataset.train_iterator(
            train_envs, seed=config.seed, batch_per_env=config.batch_per_env, start_step=start
        ),
        mesh,
    )
    loss_sum, loss_count = jnp.zeros([], jnp.float32), 0
    progress = tqdm(
        total=config.steps, initial=start, unit="step", disable=not is_main, dynamic_ncols=True
    )
    try:
        for t in range(start, config.steps):
            state, metrics = train_step(state, next(batches), step_key)
            loss_sum, loss_count = loss_sum + metrics["loss"], loss_count + 1
            progress.update(1)
            if t % config.log_every == 0:
                loss = float(metrics["loss"])
                if not np.isfinite(loss):
                    _stop_non_finite(workdir, t, loss, latest)
                progress.set_postfix(loss=f"{loss:.4f}")
                writer.write_scalars(t, {"train/loss": loss})
            if t % config.eval_every == 0 or t == config.steps - 1:
                mean_loss = float(loss_sum) / loss_count
                if not (np.isfinite(mean_loss) and _all_finite(state.params)):
                    _stop_non_finite(workdir, t, mean_loss, latest)
                record = {
                    "step": t,
                    "loss": mean_loss,
                    "epoch": (t + 1)
                    * config.batch_per_env
                    / min(len(dataset.splits[e]["in"]) for e in train_envs),
                    **evaluate(eval_step, state, dataset, mesh, config, train_envs),
                    "args": {
                        "dataset": config.dataset,
                        "algorithm": config.algorithm,
                        "test_envs": test_envs,
                        "trial_seed": config.trial_seed,
                        "seed": config.seed,
                        "hparams_seed": hparams_seed(config_dict),
                        "output_dir": os.path.abspath(workdir),
                    },
                    "hparams": {
                        k: config_dict[k]
                        for k in (
                            "lr",
                            "weight_decay",
                            "dropout",
                            "rho",
                            "alpha",
                            "batch_per_env",
                            "combine",
                            "mixstyle",
                            "perturbation",
                        )
                    },
                    "config": config_dict,
                }
                if is_main:
                    _append_record(workdir, record)
                records.append(record)
                writer.write_scalars(t, {k: v for k, v in record.items() if k.endswith("_acc")})
                if latest is not None:
                    latest.save(t + 1, args=ocp.args.StandardSave(state))
                    validation = _validation(record, train_envs)
                    if validation > best_validation:
                        best_validation = validation
                        if jax.process_count() > 1:
                            # Two managers' asynchronous saves at once can deadlock
                            # their cross-process barriers: one at a time.
                            latest.wait_until_finished()
                        best.save(t + 1, args=ocp.args.StandardSave(state))
                        if jax.process_count() > 1:
                            best.wait_until_finished()
                loss_sum, loss_count = jnp.zeros([], jnp.float32), 0
    finally:  # a pending asynchronous save completes even when the loop fails
        batches.close()  # stops the prefetching thread
        progress.close()
        if latest is not None:
            latest.wait_until_finished()
            best.wait_until_finished()
    writer.flush()
    if is_main:
        with open(os.path.join(workdir, DONE), "w") as f:
            f.write("done\n")
        print_summary(records, test_envs, dataset.env_names)
    return records


def _validation(record: dict, train_envs) -> float:
    return float(np.mean([record[f"env{e}_out_acc"] for e in train_envs]))


def _stop_non_finite(workdir, step, loss, latest):
    if latest is not None:
        latest.wait_until_finished()
    kept = (
        "no checkpoint yet"
        if latest is None or latest.latest_step() is None
        else (
            f"the last good checkpoint, step {latest.latest_step()}, is kept in "
            f"{os.path.join(workdir, 'checkpoints', 'latest')}"
        )
    )
    raise FloatingPointError(
        f"Non-finite training loss ({loss}) or parameters at step {step}; stopping. {kept}. "
        "Lower config.lr, or check the data."
    )


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
        env_names = dataset_from_config(config, open_images=False).env_names
        result = {}
        for env in range(len(env_names)):
            env_config = ml_collections.ConfigDict(config.to_dict())
            env_config.test_envs, env_config.all_test_envs = (env,), False
            records = run(env_config, os.path.join(workdir, f"test_env{env}"))
            result[env] = training_domain_validation(records, [env])[f"env{env}_in_acc"]
        average = 100 * np.mean(list(result.values()))
        table = "\n".join(
            [
                f"{config.dataset} / {config.algorithm}, test accuracy (training-domain "
                f"validation), % (the 'in' split of each test environment):",
                "",
                "| " + " | ".join(["test environment", *env_names, "Avg"]) + " |",
                "|---|" + ":-:|" * (len(env_names) + 1),
                "| accuracy | "
                + " | ".join(f"{100 * a:.1f}" for a in result.values())
                + f" | {average:.1f} |",
            ]
        )
        if is_main:
            with open(os.path.join(workdir, "results.md"), "w") as f:
                f.write(table + "\n")
            print("\n" + table + f"\n(written to {os.path.join(workdir, 'results.md')})")
    if is_main:
        print(f"Run directory: {os.path.abspath(workdir)}")
        print(f"Wall time: {_duration(time.monotonic() - start)}")
    return result
