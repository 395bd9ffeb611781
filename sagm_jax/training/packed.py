"""Packed runs: the runs of a sweep that share a program, trained together as one program.

Runs share a program when their configs differ only in per-run values
(:func:`program_problems`): the seeds and split (``seed``, ``trial_seed``,
``hparams_seed``), the held-out environments (``test_envs``; their number is the
program's) and every numeric hyperparameter of the "method" and "optimizer" sections
and the network's dropout (lr, weight decay, rho, alpha, each method's own), except the
few that shape the program (:data:`PROGRAM_HYPERPARAMETERS`). Each run's step is the one
definition of a step, ``train_step.run_train_step``, with the run's own values of the
keys that vary in the pack as traced scalars (:class:`RunConfig`; the optimizer is built
from them inside the traced function, :func:`run_step`)::

    states[r] <- step(values[r], states[r], batches[r], keys[r])   for each active run r

Two ways to step the lanes, the same numbers up to the summation order:

* :class:`VmapLanes` ("vmap", the default on several accelerators): the states stacked along a
  leading run axis, one ``jax.vmap``-ped step (:func:`packed_train_step`); a run that is
  not active is computed and discarded, so every run sees the same program whatever
  happens to the others. With several devices the run axis is sharded over a ``runs``
  mesh axis when R divides among them (each device steps whole runs).
* :class:`LoopLanes` ("loop", the default on the CPU and on one accelerator): each
  run's state stepped in turn by one compiled :func:`run_step` (the varying values are
  its arguments, so all runs share it). XLA's CPU backend runs vmapped convolutions,
  whose kernels differ per run, 3-4x slower per run than a run's own, and a CPU step
  is compute-bound anyway; on one GPU too the looped runs stepped faster. A pack saves each run's start-up and compilation and records exactly what the run
  records alone.

Each run draws its batches from its own split with its own seed, and its PRNG keys from
its own seed, exactly as alone. Everything else is per run, on the host, as
``sagm_jax.training.train`` does it for one run: the run directory (``config.json``,
``split.json``, ``results.jsonl``, ``done``), its orbax checkpoints (latest and best, of
the run's own unstacked state, so ``load_run``, ``collect_results`` and a relaunch of the
run alone read them as any run's), its evaluations (one compiled evaluation step per way
of predicting, shared by the pack), SWAD's loss valley and ``swad.jsonl``. A run that
stops (the end of its SWAD valley), is done, or is not this process's to train
(``train_pack``'s ``train``) stays in the pack inactive.

Resume: each run restores its own latest checkpoint. A pack killed between two runs'
saves resumes with its runs at different steps; the pack then steps from the earliest,
each run active from its own step on, so every run repeats exactly what it lost, in the
same program (same R, same lanes) as the uninterrupted pack: bit for bit.

``train_pack`` prints the wall time of its parts (``pack phases (s): {...}``: start-up,
the first step with its compilation, the steps, evaluation and records, checkpoints),
which ``experiments/packed_sweep.py`` reads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sagm_jax import formatting
from sagm_jax.config import fields, validate
from sagm_jax.data.pipeline import prefetch_to_mesh
from sagm_jax.methods import networks
from sagm_jax.results.selection import validation_accuracy
from sagm_jax.averaging.swad import SwadRun
from sagm_jax.training import train as train_lib
from sagm_jax.training.rundir import RunDir, evaluation_interval, is_evaluation_step
from sagm_jax.training.summary import print_summary
from sagm_jax.training.train_step import run_train_step

# Per-run keys read on the host (data, split, initialisation), never by the step but
# ``seed`` (the device augmentation's keys).
RUN_KEYS = ("seed", "trial_seed", "hparams_seed", "test_envs")
# Numeric hyperparameters that shape the program (array shapes, Python branches):
# DISAM's weight (0 is no DISAM), the discriminator's width and depth, MLDG's split,
# URM's discriminator depth, ADRMX's discriminator depth, Transfer's inner steps (its
# passes).
PROGRAM_HYPERPARAMETERS = ("disam_lambda", "mlp_width", "mlp_depth", "mldg_n_meta_test",
                           "urm_discriminator_hidden_layers", "adrmx_mlp_depth",
                           "transfer_d_steps_per_g")
RUNS = "runs"  # the mesh axis of the run axis


def traced_keys() -> tuple[str, ...]:
    """The hyperparameters that may differ within a pack: the numeric (not boolean) keys
    of the "method" and "optimizer" sections, less :data:`PROGRAM_HYPERPARAMETERS`, and
    the network's ``dropout``."""
    return tuple(
        field.key
        for name in ("method", "optimizer")
        for field in fields()[name]
        if type(field.default) in (int, float) and field.key not in PROGRAM_HYPERPARAMETERS
    ) + ("dropout",)


def program_key(config_dict: dict) -> str:
    """What a pack's runs share: the config less :data:`RUN_KEYS` and :func:`traced_keys`,
    with the number of held-out environments."""
    per_run = set(RUN_KEYS) | set(traced_keys())
    shared = {k: v for k, v in config_dict.items() if k not in per_run}
    shared["number of test_envs"] = len(config_dict.get("test_envs", ()))
    return json.dumps(shared, sort_keys=True, default=str)


def program_problems(config_dicts: list[dict]) -> list[str]:
    """Why these configs cannot be one pack: a key other than the per-run ones that
    differs (one line per key, with its values), or a run that cannot be packed."""
    problems = []
    per_run = set(RUN_KEYS) | set(traced_keys())
    for key in sorted(set().union(*config_dicts)):
        values = {json.dumps(c.get(key), default=str) for c in config_dicts}
        if key not in per_run and len(values) > 1:
            problems.append(
                f"config.{key} differs between the runs ({', '.join(sorted(values))}); a pack's "
                f"runs may differ only in {', '.join(RUN_KEYS)} and the numeric hyperparameters"
            )
    if len({len(c.get("test_envs", ())) for c in config_dicts}) > 1:
        problems.append("the runs hold out different numbers of test environments")
    for config in config_dicts[:1]:
        if config.get("perturbation") == "per_device":
            problems.append("perturbation=per_device (m-sharpness over devices) is not packed")
        if config.get("all_test_envs"):
            problems.append("all_test_envs=True: a pack's runs are single runs")
        if config.get("lr_plateau") or config.get("lr_schedule"):
            problems.append("lr_plateau/lr_schedule (ERM++'s learning rate, set on the host "
                            "after each evaluation) is not packed")
    probes = {int(c.get("linear_steps", 0)) > 0 for c in config_dicts}
    if len(probes) > 1:  # the probe wraps the optimizer state: a run alone has another
        problems.append("linear_steps is 0 in some runs and > 0 in others (a linear probe "
                        "changes the optimizer state's structure); pack them apart")
    return problems


class RunConfig:
    """One run's config inside the pack's step: the pack's shared config, with the run's
    own (traced) values of the keys that vary in the pack."""

    def __init__(self, config, values: dict):
        self._config, self._values = config, values

    def __getattr__(self, key):
        values = self.__dict__["_values"]
        return values[key] if key in values else getattr(self.__dict__["_config"], key)

    def __getitem__(self, key):
        return self.__getattr__(key)

    def get(self, key, default=None):
        return self._values[key] if key in self._values else self._config.get(key, default)


def varying_values(configs) -> dict[str, np.ndarray]:
    """``{key: [value of each run]}`` of the step's keys that differ in the pack: the seed
    and the hyperparameters of :func:`traced_keys` (float32, or int32 for integer keys)."""
    values = {}
    for key in ("seed", *traced_keys()):
        column = [c[key] for c in configs]
        if len(set(column)) > 1:
            values[key] = np.asarray(column, np.int32 if isinstance(column[0], int) else np.float32)
    return values


def run_step(config, model, num_domains: int):
    """``one_run(values, state, batch, key) -> (state, metrics)``: one run's step (the
    one definition, ``train_step.run_train_step``) with its own ``values`` (traced) of
    the keys that vary in the pack, the optimizer built from them."""
    from sagm_jax.training.train import optimizer_from_config

    def one_run(values, state, batch, key):
        run = RunConfig(config, values)
        optimizer = optimizer_from_config(run, num_domains=num_domains)
        step = run_train_step(run, run_model(model, run), optimizer, num_domains)
        return step(state, batch, key)

    return one_run


def packed_train_step(config, model, num_domains: int):
    """The pack's jitted ``step(values, states, batches, keys, active) -> (states,
    metrics)``: every run's step under ``jax.vmap`` (the module docstring); the states of
    the runs that are not ``active`` are kept as they were. A pack of one runs its step
    unbatched, the program of the run trained alone."""
    one_run = run_step(config, model, num_domains)

    def step(values, states, batches, keys, active):
        if keys.shape[0] == 1:  # a pack of one: the run's own program, bit for bit
            lane = jax.tree.map(lambda x: x[0], (values, states, batches, keys))
            stepped, metrics = jax.tree.map(lambda x: x[None], one_run(*lane))
        else:
            stepped, metrics = jax.vmap(one_run)(values, states, batches, keys)

        def keep(new, old):
            return jnp.where(active.reshape(-1, *[1] * (new.ndim - 1)), new, old)

        return jax.tree.map(keep, stepped, states), metrics

    return jax.jit(step, donate_argnums=1)


def run_model(model, config):
    """The pack's network as run ``config`` trains it: its own (traced) dropout rate, and
    its method's prediction with its own hyperparameters (``networks.method_network``)."""
    base = model.model if isinstance(model, networks.MethodModel) else model
    if not isinstance(config.dropout, (int, float)):
        base = base.clone(dropout_rate=config.dropout)
    return networks.wrap(base, *networks.method_network(config))


def packed_initial_states(config, values, variables: list, num_domains: int):
    """The runs' step-0 train states, stacked: each run's variables with the optimizer
    and objective states built from its own values, as :func:`packed_train_step`'s."""
    from sagm_jax.training.train import initial_state, optimizer_from_config

    def init(values, variables):
        run = RunConfig(config, values)
        optimizer = optimizer_from_config(run, num_domains=num_domains)
        return initial_state(run, variables, optimizer, num_domains)

    stacked = jax.tree.map(lambda *x: jnp.stack(x), *variables)
    return jax.jit(jax.vmap(init))(values, stacked)


@dataclasses.dataclass
class Member:
    """One run of a pack: its config, directory, program and progress."""

    config: Any
    rundir: RunDir
    program: Any = None  # train.Program (None for a run found done)
    checkpoints: Any = None
    swad: Any = None
    records: list = dataclasses.field(default_factory=list)
    start: int = 0  # the step it resumes at
    failed: str | None = None  # why it stopped (non-finite loss)
    final: Any = None  # its train state when the pack's loop ended

    @property
    def live(self) -> bool:
        return self.program is not None and self.failed is None


def pack_mesh(runs: int, num_devices: int = 0) -> jax.sharding.Mesh:
    """The ``runs`` mesh: the first ``num_devices`` devices (0: all) when ``runs``
    divides among them, else one."""
    devices = jax.devices()[: num_devices or None]
    if runs % len(devices):
        devices = devices[:1]
    return jax.sharding.Mesh(np.array(devices), (RUNS,))


def train_pack(configs: list, workdirs: list[str], train: set[int] | None = None,
               lanes: str | None = None) -> list[list[dict]]:
    """Trains the runs ``configs`` (one run each, in ``workdirs``) as one pack; returns
    each run's records. ``train``: the lanes to train (default all); the others, like
    the runs found done, only hold their place in the program and their directories
    are not touched. ``lanes``: "vmap" (:class:`VmapLanes`) or "loop"
    (:class:`LoopLanes`); default :func:`default_lanes`. Raises ``ValueError`` naming
    what differs when the runs cannot share a program (before any directory is written),
    and ``RuntimeError`` at the end when a run stopped on a non-finite loss (the others
    finish)."""
    trained = set(range(len(configs))) if train is None else set(train)
    start_time = time.monotonic()
    PHASES.clear()
    problems = program_problems([c.to_dict() for c in configs])
    if problems:
        raise ValueError("These runs cannot be one pack: " + "; ".join(problems) + ".")
    if jax.process_count() > 1:
        raise ValueError("A pack runs in one process; train multi-host runs unpacked.")
    mesh = pack_mesh(len(configs), configs[0].num_devices)
    eval_mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    base = configs[0]
    eval_steps = {}  # one compiled evaluation per way of predicting (_prediction)
    members, variables = [], []
    for lane, (config, workdir) in enumerate(zip(configs, workdirs)):
        validate(config, device_count=jax.device_count())
        rundir = RunDir(workdir, is_main=True)
        member = Member(config, rundir)
        members.append(member)
        variables.append(None)
        if lane not in trained:
            continue
        rundir.check_config(config.to_dict())
        if rundir.done:
            member.records = train_lib.finished_records(rundir, config)
            continue
        member.program, variables[-1] = train_lib.open_run(config, eval_mesh)
        evaluator = member.program.evaluator
        evaluator.shared_step = eval_steps.setdefault(
            _prediction(member.program.model), evaluator.shared_step
        )
    live = [m for m in members if m.live]
    for member in live:  # every run opened: now their directories are written
        member.checkpoints = train_lib.start_run_directory(
            member.config, member.rundir, member.program
        )
    if not live:
        return [m.records for m in members]
    template = next(v for v in variables if v is not None)
    variables = [template if v is None else v for v in variables]
    values = varying_values(configs)
    model, num_domains = live[0].program.model, len(live[0].program.train_envs)
    states = packed_initial_states(base, values, variables, num_domains)
    states = _restore(members, states)
    keys = jnp.stack([jax.random.split(jax.random.key(c.seed))[1] for c in configs])
    lanes = lanes or default_lanes()
    if lanes == "loop":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (RUNS,))
        lanes = LoopLanes(base, model, num_domains, states, values, keys, mesh.devices.flat[0])
    elif lanes == "vmap":
        lanes = VmapLanes(base, model, num_domains, states, values, keys, mesh)
    else:
        raise ValueError(f"lanes={lanes!r}: expected one of {', '.join(LANES)}.")
    PHASES["start-up"] += time.monotonic() - start_time
    _loop(base, members, lanes, mesh)
    with timed("finish"):
        for member in live:
            if member.failed is None:
                _finish(member, time.monotonic() - start_time, len(live))
    print("pack phases (s): " + json.dumps({k: round(v, 2) for k, v in PHASES.items()}))
    failed = [m for m in members if m.failed]
    if failed:
        raise RuntimeError(
            "\n".join(f"{m.rundir.workdir}: {m.failed}" for m in failed)
            + f"\n{len(failed)} of the pack's {len(members)} runs stopped; the others finished."
        )
    return [m.records for m in members]


def _prediction(model) -> str:
    """What a run's evaluation depends on besides its variables: nothing for a network
    (its dropout is off in evaluation), a method's hyperparameters for a method that
    predicts its own way (``networks.MethodModel``)."""
    if isinstance(model, networks.MethodModel):
        return json.dumps(model.hp, sort_keys=True, default=str)
    return "network"


def _restore(members: list[Member], states):
    """Each live run's latest checkpoint (its own, unstacked) in its lane; sets the
    runs' start steps, records before them and SWAD valleys."""
    lanes = []
    for r, member in enumerate(members):
        lane = jax.tree.map(lambda x, r=r: x[r], states)
        if member.live:
            restored = member.checkpoints.restore_latest(lane)
            if restored is not None:
                lane = restored
                print(f"{member.rundir.workdir}: resumed at step {int(lane.step)}.")
            member.start = int(lane.step)
            member.records = train_lib.records_before(  # a lost last record made again
                member.config, member.program, member.rundir, member.checkpoints, lane
            )
            if member.config.swad:
                member.swad = SwadRun(member.config, member.program.train_envs, member.records)
        lanes.append(jax.device_get(lane))
    return jax.tree.map(lambda *x: np.stack(x), *lanes)


def _batches(members: list[Member], first: int):
    """The pack's host batches from step ``first``: each run's own batch, stacked; a run
    not yet at its start step (or done) contributes zeros of the same shape."""
    iterators = {
        r: m.program.dataset.train_iterator(
            m.program.train_envs, seed=m.config.seed,
            batch_per_env=m.config.batch_per_env, start_step=m.start,
        )
        for r, m in enumerate(members) if m.live
    }
    pending = {r: next(it) for r, it in iterators.items()}
    zeros = jax.tree.map(np.zeros_like, next(iter(pending.values())))
    for t in itertools.count(first):
        batch = []
        for r, member in enumerate(members):
            if r in iterators and t >= member.start:
                batch.append(pending.pop(r) if r in pending else next(iterators[r]))
            else:
                batch.append(zeros)
        yield {k: np.stack([b[k] for b in batch]) for k in zeros}


def _active(members: list[Member], t: int) -> np.ndarray:
    return np.array([
        m.live and t >= m.start and not (m.swad is not None and m.swad.stopped) for m in members
    ])


LANES = ("vmap", "loop")
PHASES: collections.Counter = collections.Counter()  # seconds per part of train_pack


@contextlib.contextmanager
def timed(phase: str):
    """Adds the block's wall time to ``PHASES[phase]`` (printed at the end of a pack)."""
    start = time.monotonic()
    try:
        yield
    finally:
        PHASES[phase] += time.monotonic() - start


def default_lanes() -> str:
    """"loop" on the CPU and on one accelerator; "vmap" where several accelerators
    share the runs. The CPU's XLA backend runs the vmapped convolutions (a kernel per
    run: grouped convolutions) 3-4x slower per run than a run's own; on one H200,
    DomainBed's RotatedMNIST network in SAGM stepped 1.5-2x more run-steps/s looped
    than vmapped at every R from 1 to 128 (docs/performance.md, "Packed runs"). Only the
    vmapped program spreads the runs over devices."""
    if jax.default_backend() == "cpu" or jax.device_count() == 1:
        return "loop"
    return "vmap"


class VmapLanes:
    """The runs' train states stacked along a leading run axis (sharded over the
    ``runs`` mesh axis), stepped together by :func:`packed_train_step`; the metrics'
    sums since each run's last record stay stacked on the device."""

    def __init__(self, config, model, num_domains, states, values, keys, mesh):
        self.runs = NamedSharding(mesh, P(RUNS))
        self.states, self.values, self.keys = jax.device_put((states, values, keys), self.runs)
        self.step_fn = packed_train_step(config, model, num_domains)
        self.sums = self.last_losses = None

    def step(self, batches, active: np.ndarray) -> None:
        active_device = jax.device_put(active, self.runs)
        self.states, metrics = self.step_fn(
            self.values, self.states, batches, self.keys, active_device
        )
        self.sums = train_lib.accumulate(self.sums, metrics, active_device)
        self.last_losses = metrics["loss"]

    def losses(self) -> np.ndarray:
        return np.asarray(self.last_losses)

    def lane(self, r: int):
        return jax.tree.map(lambda x: x[r], self.states)

    def set_lane(self, r: int, state) -> None:
        self.states = jax.tree.map(lambda s, x: s.at[r].set(x), self.states, state)

    def take_means(self, r: int) -> dict:
        """Run ``r``'s metric means since its last record; starts its next sums."""
        sums = jax.device_get(self.sums)
        self.sums = jax.tree.map(lambda s: s.at[r].set(0), self.sums)
        return {k: float(total[r]) / int(n[r]) for k, (total, n) in sums.items() if int(n[r])}


class LoopLanes:
    """Each run's train state on its own, stepped one run after the other by one
    compiled step, :func:`run_step` (the values that vary are its arguments, so every
    run of the pack uses the same program); only the active runs compute."""

    def __init__(self, config, model, num_domains, states, values, keys, device):
        runs = len(keys)
        self.states = [jax.device_put(jax.tree.map(lambda x, r=r: x[r], states), device)
                       for r in range(runs)]
        self.values = [{k: v[r] for k, v in values.items()} for r in range(runs)]
        self.keys = jax.device_put(list(keys), device)
        self.step_fn = jax.jit(run_step(config, model, num_domains), donate_argnums=1)
        self.sums, self.last_losses = [None] * runs, [np.nan] * runs

    def step(self, batches, active: np.ndarray) -> None:
        for r in np.flatnonzero(active):
            batch = jax.tree.map(lambda x, r=r: x[r], batches)
            self.states[r], metrics = self.step_fn(
                self.values[r], self.states[r], batch, self.keys[r]
            )
            self.sums[r] = train_lib.accumulate(self.sums[r], metrics)
            self.last_losses[r] = metrics["loss"]

    def losses(self) -> np.ndarray:
        return np.array([float(loss) for loss in self.last_losses])

    def lane(self, r: int):
        return self.states[r]

    def set_lane(self, r: int, state) -> None:
        self.states[r] = state

    def take_means(self, r: int) -> dict:
        sums, self.sums[r] = jax.device_get(self.sums[r]), None
        return {k: float(total) / int(n) for k, (total, n) in (sums or {}).items() if int(n)}


def _loop(config, members: list[Member], lanes, mesh):
    """Steps the pack from its earliest run's step to ``config.steps``; each run logs,
    evaluates, records and saves at its own evaluation steps (``train._training_loop``'s
    order: record, then checkpoint)."""
    first = min(m.start for m in members if m.live)
    batches = prefetch_to_mesh(_batches(members, first), mesh, axis=RUNS)
    interval = evaluation_interval(config)
    progress = formatting.progress(total=config.steps, initial=first, unit="step")
    try:
        for t in range(first, config.steps):
            active = _active(members, t)
            if not active.any():
                break
            with timed("first step (compiles)" if t == first else "steps"):
                lanes.step(next(batches), active)
                if t == first:
                    jax.block_until_ready(lanes.lane(int(np.flatnonzero(active)[0])))
            progress.update(1)
            if t % config.log_every == 0:
                _check_losses(members, lanes.losses(), active, t)
            if is_evaluation_step(t, config.steps, interval):
                for r in np.flatnonzero(_active(members, t) & active):
                    _evaluate(members[r], r, lanes, t)
    finally:
        batches.close()
        progress.close()
        with timed("checkpoints"):
            for member in members:
                if member.checkpoints is not None:
                    member.checkpoints.wait()
    for r, member in enumerate(members):
        member.final = lanes.lane(r) if member.live else None


def _check_losses(members, losses, active, t):
    for r in np.flatnonzero(active):
        if not np.isfinite(losses[r]):
            members[r].failed = (
                f"Non-finite training loss ({losses[r]}) at step {t}; this run stopped "
                "(its last good checkpoint is kept). Lower config.lr, or check the data."
            )


def _evaluate(member: Member, r: int, lanes, t: int) -> None:
    """Run ``r``'s evaluation after step ``t``: its record
    (``train.evaluate_and_record``), SWAD's segment, its checkpoint."""
    with timed("steps"):  # the steps dispatched before it, until they finish
        lane = jax.block_until_ready(lanes.lane(r))
    with timed("evaluation and records"):
        evaluated = _evaluate_lane(member, r, lanes, t, lane)
    if evaluated is not None:
        with timed("checkpoints"):
            member.checkpoints.save(t, *evaluated)


def _evaluate_lane(member: Member, r: int, lanes, t: int, lane):
    """The record and SWAD's segment of run ``r`` after step ``t``; returns what its
    checkpoint saves (the state, its validation accuracy, the record's training means),
    None when it failed."""
    program = member.program
    lane = jax.device_put(lane, NamedSharding(program.mesh, P()))
    means = lanes.take_means(r)
    try:
        record = train_lib.evaluate_and_record(
            member.config, program, member.rundir, member.checkpoints, lane, t, means
        )
    except FloatingPointError as error:
        member.failed = str(error)
        return None
    member.records.append(record)
    if member.swad is not None:
        lane = member.swad.after_evaluation(lane, record)
        lanes.set_lane(r, lane)
    return lane, validation_accuracy(record, program.train_envs), means


def _finish(member: Member, wall_time: float, runs: int):
    """SWAD's final model, ``done`` (with the run's share of the pack's wall time) and
    the run's summary."""
    program = member.program
    state = jax.device_put(member.final, NamedSharding(program.mesh, P()))
    swad_record = None
    if member.swad is not None:
        swad_record = member.swad.finish(state, program, member.rundir, member.records[-1])
    member.rundir.mark_done(wall_time_s=wall_time / runs)
    print_summary(member.records, program.test_envs, program.dataset.env_names, swad_record)
