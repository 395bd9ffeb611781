"""Model selection: pure functions from evaluation records to the chosen checkpoint.

A record is one line of results.jsonl: ``step`` and ``env{i}_{part}_acc``. Every rule
reads only what ``config.eval_splits="fast"`` evaluates (``evaluation.evaluated_parts``):
the training environments' ``out`` (and, in-domain, ``test``) parts and every part of
the test environments; a pair run's validation environment is one of its test
environments. None reads a training environment's ``in`` part, so fast records (which
lack those keys) and all-split records select the same checkpoints with the same
numbers. A key a rule needs and a record lacks is an error naming it (:func:`accuracy`),
never a mean over fewer parts.
:func:`validation_accuracy` is the one definition of training-domain validation (the
training loop ranks checkpoints by it); :func:`training_domain_validation` picks the
checkpoint of one run by it; the ``*_run`` functions and :func:`sweep_selection`
implement DomainBed's selection methods across a sweep (training-domain validation,
leave-one-domain-out, and the two oracles, each named by what it does);
:func:`rank_settings` ranks a sweep's settings as DomainBed's ``list_top_hparams`` does.
"""

from __future__ import annotations

import numpy as np


def accuracy(record: dict, env: int, part: str) -> float:
    """``record["env{env}_{part}_acc"]``, or a ValueError naming the key and the step."""
    key = f"env{env}_{part}_acc"
    if key not in record:
        fast = record.get("config", {}).get("eval_splits") == "fast"
        raise ValueError(
            f"The record of step {record.get('step')} has no {key}"
            + (
                " (config.eval_splits=fast evaluates no training environment's 'in' part)"
                if fast and part == "in"
                else ""
            )
            + "; model selection needs it."
        )
    return record[key]


def validation_accuracy(record: dict, train_envs) -> float:
    """Training-domain validation of one record: the mean 'out' accuracy of the training
    environments ``train_envs``."""
    return float(np.mean([accuracy(record, e, "out") for e in train_envs]))


def training_domain_validation(records: list[dict], test_envs) -> dict:
    """The record whose mean ``out`` accuracy over the TRAINING environments is highest.

    The earliest such record wins a tie. Returns its ``step``, every
    ``env{i}_{part}_acc`` and ``validation_acc`` (the mean that chose it).
    """
    if not records:
        raise ValueError("training_domain_validation: no records to select from.")
    test_envs = {int(e) for e in test_envs}
    envs = sorted(
        {
            int(k[3:].split("_")[0])
            for k in records[0]
            if k.startswith("env") and k.endswith("_out_acc")
        }
    )
    train_envs = [e for e in envs if e not in test_envs]
    if not train_envs:
        raise ValueError(
            f"training_domain_validation: test_envs {sorted(test_envs)} leave no "
            "training environment in the records."
        )
    scores = [validation_accuracy(r, train_envs) for r in records]
    chosen = records[int(np.argmax(scores))]
    return {
        "step": chosen["step"],
        "validation_acc": max(scores),
        **{k: v for k, v in chosen.items() if k.startswith("env") and k.endswith("_acc")},
    }


# --- Selection across a sweep (DomainBed's ``model_selection.py``) ----------------
#
# A sweep gives, for one (dataset, algorithm, trial_seed, test environment ``t``),
# several hyperparameter SETTINGS. A setting's runs are keyed by their sorted
# test environments: ``{(t,): records, (t, v): records, ...}``; the pair runs
# ``(t, v)`` serve leave-one-domain-out only. Each ``*_run`` function below picks
# one checkpoint of one setting and returns ``{"step", "val_acc", "test_acc"}``
# (or None when the setting lacks the runs it needs); :func:`sweep_selection`
# then picks the setting with the highest ``val_acc``. Accuracies are fractions.
# Ties: the earliest step, then the first setting in the caller's order
# (DomainBed's stable sort-and-reverse takes the last setting; the difference
# only matters for exactly equal validation accuracies).


def training_domain_run(runs: dict, test_env: int) -> dict | None:
    """DomainBed's "training-domain validation set": the checkpoint of the single-test-env
    run with the best mean ``out`` accuracy over the training environments; ``test_acc``
    is its ``env{t}_in_acc``."""
    records = runs.get((test_env,))
    if not records:
        return None
    chosen = training_domain_validation(records, [test_env])
    return {
        "step": chosen["step"],
        "val_acc": chosen["validation_acc"],
        "test_acc": accuracy(chosen, test_env, "in"),
    }


def in_domain_run(runs: dict, test_env: int) -> dict | None:
    """Table 2's in-domain accuracy of a ``split="in_domain"`` run: the checkpoint chosen
    by training-domain validation (the training environments' ``out`` = 20% validation
    part), scored by the mean ``test`` accuracy (the 20% test part) over the training
    environments."""
    records = runs.get((test_env,))
    if not records:
        return None
    chosen = training_domain_validation(records, [test_env])
    train_envs = [
        int(k[3:].split("_")[0])
        for k in chosen
        if k.startswith("env") and k.endswith("_out_acc") and k != f"env{test_env}_out_acc"
    ]
    if not any(f"env{e}_test_acc" in chosen for e in train_envs):
        raise ValueError(
            "in_domain_run: records have no env{i}_test_acc; they are not from a "
            'split="in_domain" run.'
        )
    return {
        "step": chosen["step"],
        "val_acc": chosen["validation_acc"],
        "test_acc": float(np.mean([accuracy(chosen, e, "test") for e in sorted(train_envs)])),
    }


def oracle_last_run(runs: dict, test_env: int) -> dict | None:
    """DomainBed's "test-domain validation set (oracle)": the LAST checkpoint of the run;
    ``val_acc`` is its test-environment ``out`` accuracy (which picks the setting)."""
    records = runs.get((test_env,))
    if not records:
        return None
    last = max(records, key=lambda r: r["step"])
    return {
        "step": last["step"],
        "val_acc": accuracy(last, test_env, "out"),
        "test_acc": accuracy(last, test_env, "in"),
    }


def oracle_best_run(runs: dict, test_env: int) -> dict | None:
    """SWAD's oracle: ANY checkpoint, the one with the best test-environment ``out``
    accuracy (earliest on a tie)."""
    records = runs.get((test_env,))
    if not records:
        return None
    scores = [accuracy(r, test_env, "out") for r in records]
    chosen = records[int(np.argmax(scores))]
    return {
        "step": chosen["step"],
        "val_acc": max(scores),
        "test_acc": accuracy(chosen, test_env, "in"),
    }


def leave_one_out_run(runs: dict, test_env: int) -> dict | None:
    """DomainBed's "leave-one-domain-out cross-validation" (``LeaveOneOutSelectionMethod``).

    With ``n`` environments and test environment ``t``: at each step ``s`` where the
    single run ``(t,)`` has a record, every other environment ``v`` must have its pair
    run ``(t, v)`` evaluated at ``s`` too (else the step is skipped). The pair run
    trains on the ``n - 2`` remaining environments and holds out ``v`` as validation::

        val_acc(s)  = sum_{v != t} acc(run (t, v), step s, env{v}_in) / (n - 1)
        test_acc(s) = acc(run (t,), step s, env{t}_in)

    The step with the highest ``val_acc`` is chosen (earliest on a tie). The validation
    environment's ``in`` split (80%) is used, as in DomainBed: a test environment of the
    pair run, so ``eval_splits="fast"`` evaluates it.
    """
    single = runs.get((test_env,))
    if not single:
        return None
    n_envs = sum(1 for k in single[0] if k.startswith("env") and k.endswith("_out_acc"))
    by_step = {
        v: {r["step"]: r for r in runs.get(tuple(sorted((test_env, v))), [])}
        for v in range(n_envs)
        if v != test_env
    }
    best = None
    for record in sorted(single, key=lambda r: r["step"]):
        step = record["step"]
        if any(step not in pair for pair in by_step.values()):
            continue
        val_acc = sum(accuracy(pair[step], v, "in") for v, pair in by_step.items()) / (n_envs - 1)
        if best is None or val_acc > best["val_acc"]:
            best = {
                "step": step,
                "val_acc": float(val_acc),
                "test_acc": accuracy(record, test_env, "in"),
            }
    return best


RUN_SELECTIONS = {
    "training_domain": training_domain_run,
    "leave_one_out": leave_one_out_run,
    "oracle_last": oracle_last_run,
    "oracle_best": oracle_best_run,
}

SELECTION_NAMES = {
    "training_domain": "training-domain validation (DomainBed)",
    "leave_one_out": "leave-one-domain-out cross-validation (DomainBed)",
    "oracle_last": "test-domain validation, last checkpoint (DomainBed's oracle)",
    "oracle_best": "test-domain validation, best checkpoint (SWAD's oracle)",
}


def rank_settings(run_selection, settings: dict, test_env: int) -> list[dict]:
    """Every setting that ``run_selection`` can score, best first: DomainBed's
    ``SelectionMethod.hparams_accs``, which ``list_top_hparams`` prints.

    ``settings`` maps a setting key to its runs (``{test_envs tuple: records}``);
    ``run_selection`` is one of the ``*_run`` functions. Returns
    ``[{"step", "val_acc", "test_acc", "setting"}, ...]`` sorted by ``val_acc``
    descending; settings that lack the runs the rule needs are left out. The sort is
    stable: of equal ``val_acc``, the first in the caller's order comes first.
    """
    scored = []
    for key, runs in settings.items():
        choice = run_selection(runs, test_env)
        if choice is not None:
            scored.append({**choice, "setting": key})
    return sorted(scored, key=lambda choice: -choice["val_acc"])


def sweep_selection(run_selection, settings: dict, test_env: int) -> dict | None:
    """The setting whose chosen checkpoint has the highest ``val_acc``: the first of
    :func:`rank_settings` (``{"step", "val_acc", "test_acc", "setting"}``), or None if
    no setting qualifies."""
    ranked = rank_settings(run_selection, settings, test_env)
    return ranked[0] if ranked else None
