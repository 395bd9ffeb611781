"""EoA: the ensemble of the moving averages of finished runs (Arpit et al., NeurIPS 2022).

The members are finished runs that trained with ``config.moving_average`` (their
records are their averages', ``averaging.moving_average``) on one dataset, test
environments, network and data split (``soups.members_of``: a run that differs is
refused, naming it and the difference). Each member gives its best checkpoint's moving
average (EoA's ``best_model.pkl``: the strict improvement of the training environments'
mean ``out`` accuracy, which is our selection's earliest-on-a-tie). The ensemble's
prediction is the reference's (salesforce/ensemble-of-averages domainbed/EoA.py
``accuracy``), on each example ``x``::

    p(x) = sum_m f_m(x)          the members' logits, each in evaluation mode
    y(x) = argmax_c p(x)_c       the first largest class on a tie (torch's argmax)

summed in float32 in the members' order, as the reference's ``p += p_i``
(:func:`ensemble_prediction`). Its accuracy is computed for every split part of every
environment (``env{i}_{part}_acc``), streaming: one member's variables in memory at a
time, the per-part logit sums ``[N, C]`` kept. The record's ``env{i}_{part}_loss`` is
the cross-entropy of the mean logits ``p / M`` (the reference defines none).

The reference's script reports a test environment's accuracy over the WHOLE
environment (``dataset[env]``: its ``in`` and ``out`` parts together), where DomainBed's
tables read its ``in`` part: the record keeps both (``ensemble.whole_env_acc``).

The reference's sweep ensembles every run of a test environment, of both its trial seeds
(``EoA.py`` ``get_valid_model_selection_paths``): runs of two data splits, which its
whole-environment test accuracy tolerates. Ours refuses members of different splits
(``soups.members_of``): the record's training environments' parts would mix one
member's training data into another's validation. Ensemble each trial seed's runs.

The ensemble is a run directory of its own (``soups.write_combined_run``: its members'
paths and weights' SHA-256 in run_info.json, one record, no weights), labelled "EoA" or
"<member method> + EoA" (``methods.averaging_label``)::

    python -m sagm_jax.averaging.ensemble --out DIR RUN_DIR...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sagm_jax.averaging import soups

WEIGHTS = "moving_average"  # each member's best checkpoint's moving average


def ensemble_prediction(logits: Sequence[np.ndarray]) -> np.ndarray:
    """The reference's combination of the members' logits ``[N, C]`` each: their sum in
    float32 in the given order, then the first largest class of each row."""
    total = None
    for member in logits:
        member = np.asarray(member, np.float32)
        total = member.copy() if total is None else total + member
    return np.argmax(total, axis=-1)


_STEPS: dict = {}  # (model, dtype, image size) -> its compiled logits step, shared by members


def _logits_step(model, compute_dtype, image_size: int):
    """Jitted ``(params, batch_stats, batch, seed, key) -> logits``: the member's network
    in evaluation mode on an evaluation batch, prepared as the run's evaluation prepares
    it (``training.evaluation.seeded_eval_step``'s inputs and method arguments). Members
    with equal networks (Flax modules compare by their fields) share one compiled step."""
    try:
        return _STEPS.setdefault((model, compute_dtype, image_size),
                                 _new_logits_step(model, compute_dtype, image_size))
    except TypeError:  # a module with unhashable fields (a method's hyperparameters)
        return _new_logits_step(model, compute_dtype, image_size)


def _new_logits_step(model, compute_dtype, image_size: int):
    import jax

    from sagm_jax.data import device_augment
    from sagm_jax.methods.networks import MethodModel
    from sagm_jax.training.train_step import apply_model

    def logits(params, batch_stats, batch, seed, key):
        batch = device_augment.model_inputs(
            batch, seed, 0, image_size, stream=device_augment.EVAL_STREAM
        )
        pooled = {"mask": batch["mask"], "key": key} if isinstance(model, MethodModel) else {}
        out = apply_model(model, params, batch_stats, batch["image"], compute_dtype, **pooled)
        return out.astype(jax.numpy.float32)

    return jax.jit(logits)


def member_logits(member: soups.Member, dataset, parts) -> dict:
    """``{(env, part): (logits [N, C] float32, labels [N])}`` of ``member``'s chosen
    variables on every example of ``parts`` (padding dropped), predicted in batches of
    the member's evaluation (its record's ``eval_batch_size``), with its prediction keys
    (``evaluation.batch_key``)."""
    import jax
    import jax.numpy as jnp

    from sagm_jax.training import evaluation, loading

    model, variables, record = loading.load_run(member.path, member.step)
    config = member.config
    step = _logits_step(model, jnp.dtype(config["compute_dtype"]), config["image_size"])
    params, stats = jax.device_put(variables["params"]), jax.device_put(variables["batch_stats"])
    batch_size = int(record.get("eval_batch_size") or config.get("eval_batch_size") or 128)
    out = {}
    for env, part in parts:
        logits, labels = [], []
        for index, batch in enumerate(dataset.eval_iterator(env, part, batch_size=batch_size)):
            key = evaluation.batch_key(config["seed"], env, part, index)
            values = np.asarray(step(params, stats, batch, config["seed"], key))
            mask = np.asarray(batch["mask"], bool)
            logits.append(values[mask])
            labels.append(np.asarray(batch["label"])[mask])
        out[(env, part)] = (np.concatenate(logits), np.concatenate(labels))
    return out


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean cross-entropy of ``logits`` (float64)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(labels)), labels]))


class LogitSums:
    """The ensemble's per-part float32 logit sums, a member at a time (the reference's
    ``p += p_i``), with each member's own accuracies."""

    def __init__(self):
        self.sums: dict = {}
        self.labels: dict = {}
        self.members = 0
        self.member_accuracies: list[dict] = []

    def add(self, logits: dict, name: str) -> None:
        accuracies = {}
        for key, (values, labels) in logits.items():
            if key not in self.sums:
                self.sums[key], self.labels[key] = values.astype(np.float32), labels
            elif not np.array_equal(self.labels[key], labels):
                raise ValueError(f"{name}: its env{key[0]} '{key[1]}' labels differ from the "
                                 "first member's; the members must share the data split.")
            else:
                self.sums[key] = self.sums[key] + values.astype(np.float32)
            accuracies[f"env{key[0]}_{key[1]}_acc"] = float(
                np.mean(np.argmax(values, -1) == labels))
        self.members += 1
        self.member_accuracies.append(accuracies)

    def results(self) -> dict:
        """The ensemble's ``env{i}_{part}_acc`` (argmax of the sums) and ``_loss`` (the
        mean logits' cross-entropy)."""
        results = {}
        for (env, part), total in self.sums.items():
            labels = self.labels[(env, part)]
            results[f"env{env}_{part}_acc"] = float(np.mean(np.argmax(total, -1) == labels))
            results[f"env{env}_{part}_loss"] = _cross_entropy(total / self.members, labels)
        return results

    def whole_env_accuracy(self, env: int) -> float:
        """The reference's test accuracy: over every example of environment ``env``."""
        keys = [k for k in self.sums if k[0] == env]
        correct = sum(int(np.sum(np.argmax(self.sums[k], -1) == self.labels[k])) for k in keys)
        return correct / sum(len(self.labels[k]) for k in keys)


def eoa_label(members: Sequence[soups.Member]) -> str:
    """"EoA", or "<the members' method> + EoA" (``methods.averaging_label``); the members
    must share their method."""
    from sagm_jax import methods
    from sagm_jax.results.records import method_name

    rows = {m.path: method_name(m.record) for m in members}
    if len(set(rows.values())) > 1:
        listed = "; ".join(f"{path}: {row}" for path, row in rows.items())
        raise ValueError(f"the members train different methods ({listed}); an ensemble's row "
                         "in the tables is one method's: ensemble runs of one method.")
    return methods.averaging_label(rows[members[0].path], "eoa")


def make_ensemble(workdirs: Sequence[str], out: str, say: Callable[[str], Any] = print) -> dict:
    """EoA's ensemble of the finished moving-average runs ``workdirs``, evaluated on every
    split part and written as the run directory ``out``; returns its record, whose
    ``ensemble`` holds the members' fingerprints and accuracies and the test
    environments' whole-environment accuracies."""
    import ml_collections

    from sagm_jax import data as data_lib
    from sagm_jax.averaging.swad import validation_loss
    from sagm_jax.training import evaluation, rundir

    members = soups.members_of(workdirs, WEIGHTS)
    label = eoa_label(members)
    info = members[0].run_info
    dataset = data_lib.from_config(ml_collections.ConfigDict(members[0].config))
    parts = evaluation.evaluated_parts(dataset.splits, info["train_envs"], "all")
    sums = LogitSums()
    for k, member in enumerate(members):
        say(f"member {k + 1}/{len(members)}: {member.path} (step {member.step})")
        sums.add(member_logits(member, dataset, parts), member.path)
    results = sums.results()
    test_envs = [int(e) for e in info["test_envs"]]
    record = rundir.make_record(
        members[0].config, out, step=max(m.step for m in members),
        loss=validation_loss(results, info["train_envs"]), accuracies=results,
        test_envs=test_envs,
        smallest_env=min(len(dataset.splits[e]["in"]) for e in info["train_envs"]),
    )
    record["ensemble"] = {
        "combination": "sum of the members' logits, argmax (EoA.py accuracy)",
        "weights": WEIGHTS,
        "members": [dict(m.fingerprint(), accuracies=a)
                    for m, a in zip(members, sums.member_accuracies)],
        "whole_env_acc": {str(e): sums.whole_env_accuracy(e) for e in test_envs},
    }
    return soups.write_combined_run(out, label, members, record)


def summary(record: dict) -> str:
    """The members' and the ensemble's test accuracies, one line each: the test
    environments' ``in`` part (DomainBed's) and their whole environment (EoA's)."""
    ensemble = record["ensemble"]
    test_envs = [int(e) for e in ensemble["whole_env_acc"]]
    lines = []
    for member in ensemble["members"]:
        accs = ", ".join(f"env{e} {100 * member['accuracies'][f'env{e}_in_acc']:.1f}"
                         for e in test_envs)
        lines.append(f"  member {member['path']} (step {member['step']}): test {accs}")
    accs = ", ".join(f"env{e} {100 * record[f'env{e}_in_acc']:.1f} (whole environment "
                     f"{100 * ensemble['whole_env_acc'][str(e)]:.1f})" for e in test_envs)
    lines.append(f"{record['algorithm']} of {len(ensemble['members'])}: test {accs}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.averaging.ensemble",
        description="EoA: the ensemble (sum of logits) of finished runs' moving averages "
        "(runs trained with --config.moving_average=True), written as a run directory.",
    )
    parser.add_argument("--out", required=True, help="the ensemble's run directory")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished runs")
    args = parser.parse_args(argv)
    try:
        record = make_ensemble(args.runs, args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary(record))
    print(f"(written to {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
