"""The training program: one run (or one per test environment) from a config.

``train_and_evaluate`` is the program's entry (flax's name): one run, or one per test
environment. ``train_one_run`` reads as the loop it is: check the config and the run
directory, set up (data, model, optimizer, steps, evaluator; nothing is written until
all of it succeeded), restore, then ``_training_loop``: step, log, evaluate, record,
save. The parts live in their own modules:

  rundir        config.json, run_info.json, split.json, results.jsonl, done
  checkpoints   one orbax manager keeping the latest and the best checkpoint
  evaluation    the evaluator: ``env{i}_{part}_acc`` of a state
  train_step    the step, and the one place that decides the data-parallel mode
  summary       what a run prints when it ends: the selected step's accuracies

Steps follow DomainBed: update ``t = 0 .. steps-1``; after update ``t`` the run
evaluates when ``t % eval_every == 0`` or ``t == steps - 1`` and appends a record
with ``step = t``, ``loss`` = the mean training loss since the last record, and
``env{i}_{part}_acc`` for the split parts ``config.eval_splits`` evaluates
(``evaluation.evaluated_parts``: "fast" leaves out the training environments' 'in'
parts, which no model selection reads; "all" is every part). The record is written
(and flushed) BEFORE the checkpoint of that step (``checkpoints/<t>``), so after a
kill at any point the restart restores the newest checkpoint (state ``step = s + 1``),
drops records with ``step > s`` and repeats exactly what was lost: batches, dropout
masks and augmentations are functions of ``(seed, step)``. A resumed run (a checkpoint
exists) and a finished one relaunched first check that the data and split are those of
``split.json`` (which only a run starting at step 0 writes) and that ``results.jsonl``
holds every evaluation before the restored step (``rundir.check_steps``).

Reading a finished run back (``load_run``, ``preprocess``) is ``loading``'s.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sagm_jax import data as data_lib
from sagm_jax.models import backbones
from sagm_jax import formatting
from sagm_jax.averaging import shared_init
from sagm_jax.averaging import swad_averages as averaging
from sagm_jax.averaging import moving_average
from sagm_jax.methods import networks, objectives
from sagm_jax.averaging import valley as swad
from sagm_jax.training.checkpoints import Checkpoints
from sagm_jax.config import section, validate
from sagm_jax.data.pipeline import prefetch_to_mesh
from sagm_jax.data.splits import check_split_record
from sagm_jax.training.evaluation import Evaluator
from sagm_jax.methods.registry import update_rule
from sagm_jax.methods.update_rules import rule_optimizer
from sagm_jax.methods.linear_probe import linear_probe, probe_learning_rate
from sagm_jax.methods.procedures import make_procedure
from sagm_jax.training.rundir import (
    CHECKPOINTS,
    DONE,
    RESULTS,
    RecordsError,
    RunDir,
    evaluation_interval,
    is_evaluation_step,
    make_record,
    missing_last_record,
    read_records,
    read_run_info,
    read_swad_record,
    read_wall_time,
)
from sagm_jax.results.selection import training_domain_validation, validation_accuracy
from sagm_jax.averaging.swad import SwadRun
from sagm_jax.averaging import lr_plateau
from sagm_jax.training.summary import markdown_test_accuracies, print_summary
from sagm_jax.training.train_step import create_train_state, data_parallel_train_step

__all__ = [
    "DONE",
    "RESULTS",
    "read_records",
    "train_and_evaluate",
    "train_one_run",
]


@dataclasses.dataclass
class Program:
    """Everything a run needs, built by :func:`setup` before anything is written."""

    dataset: Any
    test_envs: list[int]
    train_envs: list[int]
    mesh: jax.sharding.Mesh
    model: Any
    state: Any  # the initial TrainState, replicated on the mesh (None in a pack)
    train_step: Any  # None in a pack, whose step is the pack's
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


def optimizer_from_config(
    config: ml_collections.ConfigDict, axis_name: str | None = None, num_domains: int = 1
):
    """The one place that turns a config into the update rule ``config.algorithm``, a
    lookup in ``sagm_jax.methods.UPDATE_RULES``: a plain or sharpness-aware rule through
    :func:`sagm_jax.methods.update_rules.rule_optimizer` (its head, then Adam with the
    "optimizer" section; preceded by ``linear_steps`` updates of the classifier alone,
    :func:`sagm_jax.methods.linear_probe.linear_probe`), a procedure (Fish, AND-mask,
    MLDG) through
    :func:`sagm_jax.methods.procedures.make_procedure` over ``num_domains`` training
    domains; each reads its own hyperparameters from the "method" section. A method's
    own parameters train at its ``learning_rate_multiplier`` times lr (MIRO's encoders).

    ``axis_name`` (the device axis of a ``shard_map``) is used by
    ``perturbation="per_device"`` only; the global mode needs none under ``jit``.
    """
    hp, adam = section(config, "method"), section(config, "optimizer")
    if update_rule(config.algorithm).kind == "procedure":
        return make_procedure(
            config.algorithm, hp, learning_rate=adam["lr"],
            weight_decay=adam["weight_decay"], num_domains=num_domains,
        )
    per_device = adam["perturbation"] == "per_device"
    network, method_hp = networks.method_network(config)
    mask = _decay_mask(config, network, method_hp)
    rule = rule_optimizer(
        config.algorithm, hp, learning_rate=adam["lr"], weight_decay=adam["weight_decay"],
        adaptive=adam["adaptive"], perturbation=adam["perturbation"],
        axis_name=axis_name if per_device else None,
        decay_mask=mask,
        group_learning_rates=networks.group_learning_rates(network, method_hp),
    )
    if isinstance(adam["linear_steps"], int) and adam["linear_steps"] == 0:
        return rule  # no probe: the rule's own state, as runs without one keep it
    return linear_probe(
        rule, linear_steps=adam["linear_steps"],
        learning_rate=probe_learning_rate(adam["linear_lr"], adam["lr"]),
        weight_decay=adam["weight_decay"], decay_mask=mask,
        axis_name=axis_name if per_device else None,
    )


def _decay_mask(config, network, method_hp):
    """The method's weight-decay mask (``networks.decay_mask``), and with
    ``config.attention_only`` only the parameters that train
    (``backbones.trains_with_attention_only``): PyTorch's Adam decays only the
    parameters that have a gradient."""
    method_mask = networks.decay_mask(network, method_hp)
    if not config.attention_only:
        return method_mask
    if method_mask is None:
        return backbones.trains_with_attention_only
    return lambda params: jax.tree.map(
        lambda a, b: a and b, method_mask(params), backbones.trains_with_attention_only(params)
    )


def setup(config: ml_collections.ConfigDict) -> Program:
    """Opens the data, builds the model, optimizer, steps and evaluator: every check
    that can fail runs here, before the run directory is written."""
    program, variables = open_run(config)
    optimizer = optimizer_from_config(
        config, axis_name="batch", num_domains=len(program.train_envs)
    )
    initial = initial_state(config, variables, optimizer, len(program.train_envs))
    program.state = jax.device_put(initial, NamedSharding(program.mesh, P()))
    program.train_step = data_parallel_train_step(
        config, program.model, optimizer, program.mesh, len(program.train_envs)
    )
    return program


def initial_state(config, variables, optimizer, num_domains: int):
    """The train state at step 0: ``variables``, the optimizer's state, the objective's,
    SWAD's averages (with ``config.swad``) and the moving average (with
    ``config.moving_average``: a copy of ``variables``)."""
    averages = None
    if config.swad:
        window = swad.segment_window(config.swad_n_tolerance, config.swad_n_converge)
        averages = averaging.init_averages(variables["params"], window)
    average = moving_average.init_moving_average(variables) if config.moving_average else None
    state = create_train_state(
        variables, optimizer, objectives.init_state(config.objective, num_domains), averages,
        average,
    )
    if config.lr_plateau or config.lr_schedule:  # ERM++'s learning-rate factor
        state = state.replace(lr_factor=jnp.ones([], jnp.float32))
    return state


def open_run(config, mesh=None) -> tuple[Program, dict]:
    """The run's data, environments, mesh (``mesh`` or the config's), network and
    evaluator: a :class:`Program` without state or step, and the network's initial
    variables."""
    dataset = data_lib.from_config(config)
    test_envs, train_envs = _environments(config, dataset)
    mesh = mesh or _mesh(config, train_envs)
    init_key = jax.random.split(jax.random.key(config.seed))[0]
    model, variables, weights = networks.from_config(
        config, dataset.num_classes, dataset.input_shape, len(train_envs), init_key,
        imagenet_inputs=data_lib.get_spec(config.dataset).kind == "folder",
    )
    variables, started_from = shared_init.initial_variables(config, variables, dataset)
    run_info = {
        "weights": weights,
        "dataset": config.dataset,
        "env_names": dataset.env_names,
        "num_classes": dataset.num_classes,
        "class_names": list(dataset.class_names),
        "input_shape": list(dataset.input_shape),
        "fingerprint": dataset.fingerprint,
        "train_envs": train_envs,
        "test_envs": test_envs,
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        **started_from,
    }
    program = Program(
        dataset=dataset,
        test_envs=test_envs,
        train_envs=train_envs,
        mesh=mesh,
        model=model,
        state=None,
        train_step=None,
        evaluator=Evaluator(model, dataset, mesh, config, train_envs),
        run_info=run_info,
    )
    return program, variables


def train_one_run(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    """Trains one run with ``config.test_envs`` held out; returns its records."""
    import time

    start = time.monotonic()
    validate(config, device_count=jax.device_count())
    rundir = RunDir(workdir, is_main=jax.process_index() == 0)
    config_dict = config.to_dict()
    rundir.check_config(config_dict)  # first, finished run or not
    if rundir.done:
        return finished_records(rundir, config)
    program = setup(config)
    checkpoints = start_run_directory(config, rundir, program)
    state = checkpoints.restore_latest(program.state)
    if state is None:
        state = program.state
    else:
        print(f"{workdir}: resumed at step {int(state.step)}.")
    records = records_before(config, program, rundir, checkpoints, state)
    swad_run = SwadRun(config, program.train_envs, records) if config.swad else None
    lr_run = lr_plateau.learning_rate_run(config, program.train_envs, records)
    new_records, state = _training_loop(config, program, rundir, checkpoints, state, swad_run,
                                        lr_run)
    records += new_records
    swad_record = None
    if swad_run is not None:
        swad_record = swad_run.finish(state, program, rundir, records[-1])
    rundir.mark_done(wall_time_s=time.monotonic() - start)
    if rundir.is_main:
        print_summary(records, program.test_envs, program.dataset.env_names, swad_record)
    return records


def start_run_directory(config, rundir: RunDir, program: Program) -> Checkpoints:
    """Writes the run directory of a run about to train (``split.json`` only at step 0;
    a resumed run's data is first checked against it); returns its checkpoints."""
    checkpoints = Checkpoints(rundir.workdir, enabled=config.checkpoint)
    resuming = checkpoints.latest_step() is not None
    if resuming:  # before anything is rewritten: its records come from the recorded data
        check_split_record(rundir.workdir, program.dataset)
    rundir.start(config.to_dict(), program.run_info, program.dataset, write_split=not resuming)
    if rundir.is_main and program.dataset.skipped:
        print(f"Skipped {len(program.dataset.skipped)} unreadable files (listed in split.json).")
    return checkpoints


def finished_records(rundir: RunDir, config) -> list[dict]:
    """A done run's records, once its data and records are checked: a sweep relaunched
    on changed data must not mix this run's results with new ones."""
    check_split_record(rundir.workdir, data_lib.from_config(config, open_images=False))
    try:
        records = read_records(rundir.workdir)
    except RecordsError:
        step = missing_last_record(rundir.workdir)
        if step is None:
            raise
        program = setup(config)
        checkpoints = Checkpoints(rundir.workdir, enabled=config.checkpoint)
        state = _restored(checkpoints, step, program.state, rundir.workdir)
        records = records_before(config, program, rundir, checkpoints, state)
    if rundir.is_main:
        env_names = read_run_info(rundir.workdir)["env_names"]
        print(f"{rundir.workdir}: already done; not training again.")
        swad_record = read_swad_record(rundir.workdir)
        print_summary(records, list(config.test_envs), env_names, swad_record)
    return records


def records_before(config, program: Program, rundir: RunDir, checkpoints, state) -> list[dict]:
    """The records before the restored ``state`` (``RunDir.records_before``). Where
    the one of the restored checkpoint's own step alone is missing (a torn or lost last
    line), it is made again (:func:`rebuild_record`)."""
    step = int(state.step)
    try:
        return rundir.records_before(step)
    except RecordsError:
        if step == 0 or missing_last_record(rundir.workdir, before=step) != step - 1:
            raise
    return rebuild_record(config, program, rundir, checkpoints, state)


def rebuild_record(config, program: Program, rundir: RunDir, checkpoints, state) -> list[dict]:
    """The record of checkpoint ``state.step - 1``, lost from ``results.jsonl``, made
    again: its accuracies evaluated again from the checkpoint (evaluation is a function
    of the variables and the data alone), its ``loss`` and the method's means from the
    checkpoint's metrics (:meth:`Checkpoints.save`). Rewrites the file with the records
    before it, then appends it; says so in one line. Returns the records."""
    step = int(state.step) - 1
    results = os.path.join(rundir.workdir, RESULTS)
    training = checkpoints.training_metrics(step)
    if training is None:
        raise RecordsError(
            f"{results}: the record of step {step} is lost, and "
            f"{os.path.join(rundir.workdir, CHECKPOINTS, str(step))} predates the training "
            "metrics checkpoints keep, so it cannot be made again. To train the run again "
            f"in this directory, delete {os.path.join(rundir.workdir, CHECKPOINTS)} and "
            f"{os.path.join(rundir.workdir, DONE)} and run the same command."
        )
    records = rundir.records_before(step)
    record = evaluate_and_record(config, program, rundir, checkpoints, state, step, training)
    if rundir.is_main:
        print(
            f"Warning: {results}: the record of step {step} was lost (a torn last line); "
            f"made again from {os.path.join(rundir.workdir, CHECKPOINTS, str(step))}.",
            file=sys.stderr, flush=True,
        )
    return records + [record]


def _restored(checkpoints: Checkpoints, step: int, state, workdir: str):
    """Checkpoint ``step`` into ``state``'s shapes; the records' error where it is not
    kept (a run without checkpoints, or pruned)."""
    if step not in (checkpoints.manager.all_steps() if checkpoints.manager else []):
        raise RecordsError(
            f"{os.path.join(workdir, RESULTS)}: the record of step {step} is lost and no "
            f"checkpoint of step {step} is kept to make it again: rerun in a new --workdir."
        )
    return checkpoints.restore(step, state)


def _training_loop(
    config, program: Program, rundir: RunDir, checkpoints: Checkpoints, state, swad_run,
    lr_run=None,
):
    """Steps from ``state.step`` to ``config.steps`` (or to the end of SWAD's loss valley);
    returns the new records and the last state."""
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
    interval = evaluation_interval(config)
    sums = None  # of the step's metrics since the last record, on the device (accumulate)
    progress = formatting.progress(
        total=config.steps, initial=start, unit="step", disable=not rundir.is_main
    )
    try:
        for t in range(start, config.steps):
            if swad_run is not None and swad_run.stopped:
                break
            if lr_run is not None and lr_run.stopped:  # ERM++'s stage 1 ends
                break
            state, metrics = program.train_step(state, next(batches), step_key)
            sums = accumulate(sums, metrics)
            progress.update(1)
            if t % config.log_every == 0:
                loss = _finite_loss(float(metrics["loss"]), t, checkpoints, rundir)
                progress.set_postfix(loss=f"{loss:.4f}")
                writer.write_scalars(t, {"train/loss": loss})
            if is_evaluation_step(t, config.steps, interval):
                means = {k: float(total) / int(n) for k, (total, n) in sums.items() if int(n)}
                record = evaluate_and_record(config, program, rundir, checkpoints, state, t, means)
                records.append(record)
                writer.write_scalars(t, {k: v for k, v in record.items() if k.endswith("_acc")})
                if swad_run is not None:
                    state = swad_run.after_evaluation(state, record)
                if lr_run is not None:  # ERM++'s learning rate after this evaluation
                    state = lr_run.after_evaluation(state, record)
                validation = validation_accuracy(record, program.train_envs)
                checkpoints.save(t, state, validation, means)
                sums = None
    finally:  # the prefetch thread and the progress bar end even when the loop fails
        batches.close()  # stops the prefetching thread
        progress.close()
        checkpoints.wait()
    writer.flush()
    return records, state


def accumulate(sums, metrics, counted=True):
    """Each metric's sum since the last record and the number of steps that reported
    it: a procedure that alternates reports NaN for the loss its step did not compute
    (DANN's ``disc_loss`` and ``gen_loss``), and a record holds the mean over the steps
    that computed it, as DomainBed's means over the steps that returned the key (a key
    no step computed is left out). ``loss`` counts every step, so a NaN loss stays
    NaN and stops the run. ``counted`` (a pack's runs that stepped) masks the others."""

    def reported(key, value):
        n = jnp.ones(jnp.shape(value), jnp.int32) if key == "loss" else (~jnp.isnan(value))
        n = n.astype(jnp.int32) * jnp.asarray(counted, jnp.int32)
        return jnp.where(n > 0, value, 0.0), n

    step = {key: reported(key, value) for key, value in metrics.items()}
    return step if sums is None else jax.tree.map(jnp.add, sums, step)


def evaluate_and_record(
    config, program: Program, rundir: RunDir, checkpoints, state, t, means
) -> dict:
    """Evaluates ``state`` after step ``t`` and appends its record (before the
    checkpoint: see the module docstring); ``means`` are the step metrics' means. With
    ``config.moving_average`` the accuracies are the moving average's, and the record
    says so (``record["moving_average"]``: ``moving_average.describe``)."""
    means = dict(means)  # the caller keeps its means (the checkpoint saves them)
    mean_loss = _finite_loss(means.pop("loss"), t, checkpoints, rundir)
    if not _all_finite(state.params):
        _stop_non_finite(rundir.workdir, t, mean_loss, checkpoints)
    record = make_record(
        config.to_dict(),
        rundir.workdir,
        step=t,
        loss=mean_loss,
        metrics=means,
        # With config.moving_average the run predicts with its average (EoA's predict).
        accuracies=program.evaluator(moving_average.predicting(state)),
        test_envs=program.test_envs,
        smallest_env=min(len(program.dataset.splits[e]["in"]) for e in program.train_envs),
    )
    if config.moving_average:
        record["moving_average"] = moving_average.describe(config, state)
    rundir.append(record)
    return record


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
        f"{os.path.join(workdir, CHECKPOINTS, str(latest))}"
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


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, launched: float | None = None
) -> Any:
    """Runs ``config.test_envs``, or every environment in turn with ``config.all_test_envs``
    (then prints the table of test accuracies and writes it to ``workdir/results.md``).
    Starts by printing the run directory, ends with the wall time of the launch since
    ``launched`` (a ``time.monotonic()``; ``sagm_jax.main`` passes its process's start,
    default: this call)."""
    import time

    start, is_main = time.monotonic() if launched is None else launched, jax.process_index() == 0
    earlier = []  # the recorded wall times of the runs found finished

    def train_or_read(run_config, run_workdir):
        recorded = read_wall_time(run_workdir)
        records = train_one_run(run_config, run_workdir)
        if recorded is not None:
            earlier.append(recorded)
        return records

    if is_main:
        print(f"Run directory: {os.path.abspath(workdir)}", flush=True)
    if not config.all_test_envs:
        result = train_or_read(config, workdir)
    else:
        env_names = data_lib.from_config(config, open_images=False).env_names
        result = {}
        for env in range(len(env_names)):
            env_config = ml_collections.ConfigDict(config.to_dict())
            env_config.test_envs, env_config.all_test_envs = (env,), False
            records = train_or_read(env_config, os.path.join(workdir, f"test_env{env}"))
            result[env] = training_domain_validation(records, [env])[f"env{env}_in_acc"]
        table = markdown_test_accuracies(config, env_names, result)
        if is_main:
            with open(os.path.join(workdir, "results.md"), "w") as f:
                f.write(table + "\n")
            print("\n" + table + f"\n(written to {os.path.join(workdir, 'results.md')})")
    if is_main:  # the run directory was printed first, once
        print(wall_time_line(time.monotonic() - start, earlier))
    return result


def wall_time_line(elapsed: float, earlier: list[float]) -> str:
    """``Wall time: ...``: this launch's ``elapsed`` seconds, plus, where runs were found
    finished, the wall times recorded by the launches that trained them."""
    if not earlier:
        return f"Wall time: {formatting.duration(elapsed)}"
    return (
        f"Wall time: {formatting.duration(sum(earlier) + elapsed)} "
        f"({formatting.duration(sum(earlier))} recorded when it trained, "
        f"{formatting.duration(elapsed)} this launch)"
    )
