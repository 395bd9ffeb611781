"""Soups: weight averages across finished runs (model soups, DiWA), uniform and greedy.

A soup averages the weights of M finished runs, its MEMBERS, that share one dataset,
test environments, network (the same parameter tree) and data split (``split.json``):
the runs of a DiWA population fine-tuned from one shared initialisation. Each member
gives the weights ``--weights`` names: its ``best`` checkpoint (the step training-domain
validation selects), its ``last``, its ``swad`` model, or its ``moving_average`` (the
best step's simple moving average of a run that kept one: such a run predicts with its
average, so its ``best`` and ``last`` are its average's too, as ``load_run`` gives them).

    uniform  theta = (1/M) sum_m theta_m over every member (DiWA's ``uniform``,
             alexrame/diwa domainbed/scripts/diwa.py ``main``; ``DiWA.add_weights`` in
             domainbed/algorithms_inference.py keeps the running mean
             ``(theta * count + theta_m) / (count + 1)``, the same mean).
    greedy   DiWA's "restricted" selection (diwa.py ``main``): members sorted by their
             score, decreasing (Python's stable sort: equal scores keep the listing
             order); the score is misc.get_score of the member's record, the mean over
             the training environments of ``env{i}_out_acc``. Each member in turn joins
             the candidate soup, the mean of the accepted members and itself; the
             candidate's accuracy on the MERGED training environments' ``out`` parts
             (correct / count over their union, misc.MergeDataset) is computed, and the
             member is accepted when it is >= the best so far (ties accepted; the first
             member always), else dropped. The soup is the mean of the accepted.

Streaming: a member's variables are read from its run directory when they are added and
dropped after; the soup keeps float64 running sums (uniform: one; greedy: the accepted
members' and the candidate's) and casts the mean to float32 at the end, so M ResNet-50s
never sit in memory together.

BatchNorm: with frozen BatchNorm (every member's ``freeze_batchnorm``, the default) the
members' statistics are ImageNet's, the same in each (checked, and kept); DiWA's
``add_weights`` averages ``parameters()`` only and keeps the first member's buffers,
which is the same. With trainable BatchNorm the soup's statistics are re-estimated for
the averaged weights as SWAD's final model's are (``averaging.swad.recompute_batchnorm``:
the mean over ``swad_batchnorm_batches`` training minibatches of their batch statistics),
for each greedy candidate too.

A soup is a run directory of its own (:func:`write_combined_run`, which EoA's ensemble,
``averaging.ensemble``, writes too): ``config.json`` (the first member's config with
``combined_label`` and ``combined_members``), ``run_info.json`` (the first member's plus
``members``), ``split.json`` (the members'), ``results.jsonl`` (one record, its
``args.algorithm`` and ``algorithm`` the soup's label, ``soup`` what made it), its
variables as the checkpoint of that record's step, and ``done``; ``load_run`` and
``collect_results`` read it as a run (its row: the label, ``methods.averaging_label``).

    python -m sagm_jax.averaging.soups --out DIR --selection uniform|greedy \\
        --weights best|last|swad|moving_average RUN_DIR...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sagm_jax.results.selection import training_domain_validation, validation_accuracy
from sagm_jax.training import checkpoints, rundir

WEIGHTS = ("best", "last", "swad", "moving_average")
SELECTIONS = ("uniform", "greedy")


@dataclasses.dataclass(frozen=True)
class Member:
    """A finished run as a soup's (or an ensemble's) member: its absolute ``path``, the
    ``weights`` it gives, the ``step`` and ``record`` of those weights, their ``sha256``
    (``checkpoints.weights_sha256``), its ``score`` (misc.get_score of the record: the training
    environments' mean ``out`` accuracy), its config, run_info and split record."""

    path: str
    weights: str
    step: int
    sha256: str
    score: float
    record: dict
    config: dict
    run_info: dict
    split: dict

    def variables(self) -> dict:
        """The member's chosen ``{'params', 'batch_stats'}`` as host arrays, read again
        from its run directory (nothing is kept in memory between calls) and checked
        against its SHA-256: weights that changed since :func:`members_of` read them
        are a ValueError naming the run."""
        variables = _read_variables(self.path, self.weights, self.config, self.step)[0]
        if checkpoints.weights_sha256(variables) != self.sha256:
            raise ValueError(
                f"{self.path}: its {self.weights} weights (step {self.step}) changed since "
                "the soup's members were read; make the soup again once the run is left "
                "as it is."
            )
        return variables

    def fingerprint(self) -> dict:
        """What names the member in a soup: its path, weights, step and the SHA-256 of
        those weights' bytes."""
        return {"path": self.path, "weights": self.weights, "step": self.step,
                "sha256": self.sha256, "score": self.score}


def _read_variables(path: str, weights: str, config: dict, step: int | None):
    """``(variables, step, record)`` of run ``path``'s ``weights`` (``step``: the one
    already chosen, or None to choose it now)."""
    if weights not in WEIGHTS:
        raise ValueError(f"--weights {weights!r}: expected one of {', '.join(WEIGHTS)}.")
    if weights == "swad":
        record = rundir.read_swad_record(path)
        if record is None:
            raise ValueError(
                f"{path}: --weights swad, but the run has no SWAD model (swad.jsonl): it "
                "did not train with --config.swad=True."
            )
        return checkpoints.restore_swad_variables(path), int(record["step"]), record
    if weights == "moving_average" and not config.get("moving_average"):
        raise ValueError(
            f"{path}: --weights moving_average, but the run did not train with "
            "--config.moving_average=True."
        )
    # A run that kept a moving average predicts with it: its records are the average's
    # and restore_variables gives it (at its best step for "moving_average").
    records = rundir.read_records(path)
    if not records:
        raise ValueError(f"{path}: the run has no records ({rundir.RESULTS}).")
    if step is None:
        step = (records[-1]["step"] if weights == "last"
                else training_domain_validation(records, config["test_envs"])["step"])
    record = next(r for r in records if r["step"] == step)
    return checkpoints.restore_variables(path, step), int(step), record


@dataclasses.dataclass(frozen=True)
class _RunFiles:
    """What a run directory says of its run before its weights are read."""

    path: str
    config: dict
    run_info: dict
    split: dict


def _run_files(path: str) -> _RunFiles:
    path = os.path.abspath(path)
    if not os.path.exists(os.path.join(path, rundir.DONE)):
        raise ValueError(
            f"{path}: not a finished run (no '{rundir.DONE}' file); a soup averages "
            "finished runs."
        )
    config = rundir.read_config(path)
    if config.get(rundir.COMBINED_LABEL):
        raise ValueError(
            f"{path}: a run combined from others ({config[rundir.COMBINED_LABEL]}); a soup "
            "averages trained runs: list its members instead."
        )
    with open(os.path.join(path, rundir.SPLIT)) as f:
        split = json.load(f)
    return _RunFiles(path, config, rundir.read_run_info(path), split)


def _member(files: _RunFiles, weights: str) -> tuple[Member, list]:
    """The member of run ``files`` and its parameter tree's ``(path, shape, dtype)``
    list."""
    import jax

    variables, step, record = _read_variables(files.path, weights, files.config, None)
    tree = [
        (jax.tree_util.keystr(key), tuple(np.shape(leaf)), str(np.asarray(leaf).dtype))
        for key, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
    ]
    score = validation_accuracy(record, files.run_info["train_envs"])
    member = Member(files.path, weights, step, checkpoints.weights_sha256(variables), score,
                    record, files.config, files.run_info, files.split)
    return member, tree


def _differences(first: Member, files: _RunFiles) -> list[str]:
    """What keeps run ``files`` out of a soup whose first member is ``first``, in words
    (the parameter trees are compared once the weights are read)."""
    from sagm_jax.data import splits

    found = [
        f"{key} {first.config.get(key)!r} -> {files.config.get(key)!r}"
        for key in ("dataset", "arch")
        if first.config.get(key) != files.config.get(key)
    ]
    envs = [sorted(int(e) for e in c["test_envs"]) for c in (first.config, files.config)]
    if envs[0] != envs[1]:
        found.append(f"test_envs {envs[0]} -> {envs[1]}")
    if not found:
        found += splits.split_changes(first.split, files.split)
    return found


def _tree_differences(first_tree: list, tree: list) -> list[str]:
    if first_tree == tree:
        return []
    odd = sorted(set(first_tree) ^ set(tree))
    return [f"the parameter trees differ ({len(odd)} leaves, e.g. {odd[:3]})"]


def members_of(workdirs: Sequence[str], weights: str) -> list[Member]:
    """The finished runs ``workdirs`` as members giving their ``weights`` (one of
    :data:`WEIGHTS`), in the order given. Each is read once (its weights hashed, then
    dropped). They must share the dataset, test environments, network and parameter
    tree, and data and split (``split.json``: dataset fingerprint, trial seed, holdout,
    indices): a run that differs from the first is a ValueError naming it and each
    difference; so is a run listed twice, or not finished."""
    if not workdirs:
        raise ValueError("A soup needs at least one run directory.")
    members, first_tree = [], None
    for workdir in workdirs:
        files = _run_files(workdir)
        if any(m.path == files.path for m in members):
            raise ValueError(f"{files.path}: listed twice; a member joins a soup once.")
        problems = _differences(members[0], files) if members else []
        if not problems:
            member, tree = _member(files, weights)
            first_tree = first_tree or tree
            problems = _tree_differences(first_tree, tree)
        if problems:
            more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
            raise ValueError(
                f"{files.path} cannot join the runs of {members[0].path}: "
                f"{'; '.join(problems[:4])}{more}. A soup averages runs of one dataset, "
                "test environments, network and data split."
            )
        members.append(member)
    return members


def combined_config(label: str, members: Sequence[Member]) -> dict:
    """The config of a run combined from ``members``: the first member's, with
    ``combined_label`` (its row in the tables, ``rundir.combined_label``) and
    ``combined_members`` (the members' paths and weights' SHA-256), so that two soups of
    other members are two settings, as two runs of other hyperparameters are; its
    ``eval_splits`` is "all": a combined run's record holds every split part."""
    config = dict(members[0].config)
    config["eval_splits"] = "all"  # its record holds every split part
    config[rundir.COMBINED_LABEL] = label
    config[rundir.COMBINED_MEMBERS] = [f"{m.path}@{m.step}:{m.sha256}" for m in members]
    return config


def write_combined_run(out: str, label: str, members: Sequence[Member], record: dict,
                       variables: dict | None = None) -> dict:
    """Writes the run directory ``out`` of a run combined from ``members`` (a soup, an
    ensemble): config.json (:func:`combined_config`), run_info.json (the first member's
    plus ``members``: each :meth:`Member.fingerprint`), split.json (the members'),
    results.jsonl holding ``record`` (a ``rundir.make_record`` record, its ``config``,
    ``hparams`` and ``args`` set here to the combined run's: ``args.algorithm`` and
    ``algorithm`` are ``label``), ``variables`` (``{'params', 'batch_stats'}``, or None
    for an ensemble, which has no weights of its own) as the checkpoint of the record's
    step, which ``load_run(out)`` reads, then ``done``. Returns the record written.

    ``out`` must not hold a finished run, nor be a member; an unfinished one (a kill
    while it was written) is written again."""
    out = os.path.abspath(out)
    if any(m.path == out for m in members):
        raise ValueError(f"--out {out} is one of the members; write the soup elsewhere.")
    if os.path.exists(os.path.join(out, rundir.DONE)):
        raise ValueError(
            f"--out {out} already holds a finished run; choose another folder, or delete it."
        )
    config = combined_config(label, members)
    record = dict(record)
    record.update(algorithm=label, config=config, hparams=rundir.hyperparameters(config))
    record["args"] = dict(record["args"], algorithm=label, output_dir=out,
                          hparams_seed=rundir.hparams_seed(config))
    os.makedirs(out, exist_ok=True)
    for name in (rundir.RESULTS, rundir.CHECKPOINTS):
        stale = os.path.join(out, name)
        if os.path.isdir(stale):
            shutil.rmtree(stale)
        elif os.path.exists(stale):
            os.remove(stale)
    info = dict(members[0].run_info, members=[m.fingerprint() for m in members])
    rundir.write_json(os.path.join(out, rundir.CONFIG), config)
    rundir.write_json(os.path.join(out, rundir.RUN_INFO), info)
    shutil.copyfile(os.path.join(members[0].path, rundir.SPLIT),
                    os.path.join(out, rundir.SPLIT))
    run = rundir.RunDir(out)
    run.append(record)
    if variables is not None:
        saved = checkpoints.Checkpoints(out)
        saved.save(int(record["step"]), variables,
                   validation_accuracy(record, info["train_envs"]))
        saved.wait()
    run.mark_done()
    return record


# ---- the averages, streaming ------------------------------------------------------


def _add(total, variables, in_place: bool = False):
    """``total + variables['params']`` in float64 (``total`` None: the first), into
    ``total`` itself where ``in_place`` (each float32 value is exact in float64, and the
    sum is rounded to float64 once either way)."""
    import jax

    if total is None:
        return jax.tree.map(lambda x: np.array(x, np.float64), variables["params"])
    if in_place:
        return jax.tree.map(lambda t, x: np.add(t, np.asarray(x), out=t), total,
                            variables["params"])
    return jax.tree.map(lambda t, x: np.add(t, np.asarray(x)), total, variables["params"])


def _mean(total, count: int):
    """The float32 mean of a float64 sum of ``count`` members' parameters."""
    import jax

    return jax.tree.map(lambda t: (t / count).astype(np.float32), total)


class _Statistics:
    """The members' BatchNorm statistics: frozen BatchNorm's, checked to be the same in
    each member as it is read (:meth:`check`), or None where they are re-estimated."""

    def __init__(self, members: Sequence[Member]):
        self.frozen = all(m.config.get("freeze_batchnorm", True) for m in members)
        self.first_path, self.stats = members[0].path, None

    def check(self, member: Member, variables: dict) -> None:
        import jax

        stats = variables.get("batch_stats") or {}
        if self.stats is None:
            self.stats = stats
            return
        if not self.frozen:
            return
        same = jax.tree.structure(stats) == jax.tree.structure(self.stats) and all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stats),
                                                 jax.tree.leaves(self.stats))
        )
        if not same:
            raise ValueError(
                f"{member.path}: its frozen BatchNorm statistics differ from those of "
                f"{self.first_path}; members with frozen BatchNorm share the pretrained "
                "network's statistics, so these runs did not start from one network."
            )


def uniform_soup(members: Sequence[Member], statistics: _Statistics | None = None) -> dict:
    """``{'params': mean, 'batch_stats': the first member's}``: the float32 mean of the
    members' parameters, summed in float64 one member at a time."""
    statistics = statistics or _Statistics(members)
    total = None
    for member in members:
        variables = member.variables()
        statistics.check(member, variables)
        total = _add(total, variables, in_place=True)
        del variables
    return {"params": _mean(total, len(members)), "batch_stats": statistics.stats}


def greedy_selection(scores: Sequence[float], accuracy_of: Callable[[list[int]], float],
                     say: Callable[[str], Any] = print) -> dict:
    """DiWA's restricted selection (alexrame/diwa domainbed/scripts/diwa.py ``main``) over
    members ``0 .. len(scores)-1``: the order (decreasing score, equal scores in index
    order), then each member in turn: ``accuracy_of(accepted + [member])`` (the
    candidate soup's accuracy) is computed and the member is accepted when it is >= the
    best so far (the first always). ``say`` gets one line per decision. Returns
    ``{"order", "accepted", "accuracies", "best"}`` (``accuracies[k]``: the candidate's
    accuracy when ``order[k]`` was tried)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    accepted, accuracies, best = [], [], -float("inf")
    for k, i in enumerate(order):
        accuracy = float(accuracy_of(accepted + [i]))
        accuracies.append(accuracy)
        if accuracy >= best:
            accepted, best = accepted + [i], accuracy
            verdict = "accepted"
        else:
            verdict = f"skipped (below the best, {best:.4f})"
        say(f"greedy {k + 1}/{len(order)}: member {i} (score {scores[i]:.4f}): the soup of "
            f"{len(accepted) if verdict == 'accepted' else len(accepted) + 1} has merged "
            f"validation accuracy {accuracy:.4f}: {verdict}")
    return {"order": order, "accepted": accepted, "accuracies": accuracies, "best": best}


class _PrefixSums:
    """The float64 parameter sums of the members a greedy selection tries, streaming:
    each candidate is an accepted prefix plus one member, so the sums of the last
    accepted members and of the last candidate are all that is kept."""

    def __init__(self, members: Sequence[Member], statistics: _Statistics):
        self.members, self.statistics = members, statistics
        self.sums: dict[tuple, Any] = {(): None}

    def mean(self, candidate: list[int]) -> dict:
        held, new = tuple(candidate[:-1]), candidate[-1]
        variables = self.members[new].variables()
        self.statistics.check(self.members[new], variables)
        total = _add(self.sums[held], variables)
        self.sums = {held: self.sums[held], tuple(candidate): total}
        return {"params": _mean(total, len(candidate)), "batch_stats": self.statistics.stats}


# ---- evaluating a soup ------------------------------------------------------------


class _Evaluation:
    """The members' data, network and evaluator (``train.open_run`` of the first
    member's config), evaluating a soup on every split part (``eval_splits="all"``), and
    a greedy candidate on the parts DiWA's script evaluates each candidate on (its
    ``train`` out parts and its test environment): ``"fast"``'s. BatchNorm is
    re-estimated first where it trains."""

    def __init__(self, members: Sequence[Member], statistics: _Statistics):
        import ml_collections

        from sagm_jax.training import evaluation, train

        self.config = ml_collections.ConfigDict(dict(members[0].config, eval_splits="all"))
        self.program, _ = train.open_run(self.config)
        self.statistics = statistics
        self.every_part = list(self.program.evaluator.parts)
        self.candidate_parts = evaluation.evaluated_parts(
            self.program.dataset.splits, self.program.train_envs, "fast")

    def prepare(self, variables: dict):
        """The soup's variables on the devices, as a state the evaluator reads, its
        BatchNorm statistics re-estimated where it trains."""
        import jax
        from flax import struct
        from jax.sharding import NamedSharding, PartitionSpec

        from sagm_jax.averaging.swad import recompute_batchnorm

        @struct.dataclass
        class SoupState:
            params: Any
            batch_stats: Any
            step: int = struct.field(pytree_node=False, default=0)

        state = SoupState(variables["params"], variables["batch_stats"] or {},
                          int(self.config.steps))
        state = jax.device_put(state, NamedSharding(self.program.mesh, PartitionSpec()))
        if not self.statistics.frozen and jax.tree.leaves(state.batch_stats):
            state = recompute_batchnorm(state, self.program, self.config)
        return state

    def __call__(self, state, parts) -> dict:
        """The evaluator's ``env{i}_{part}_acc`` and ``_loss`` of ``state`` on ``parts``."""
        evaluator = self.program.evaluator
        evaluator.parts = list(parts)
        try:
            return evaluator(state)
        finally:
            evaluator.parts = self.every_part

    def merged_validation(self, results: dict) -> float:
        """The accuracy on the training environments' ``out`` parts merged into one set
        (diwa.py's ``train`` split, a MergeDataset): their correct answers over their
        examples. Each part's accuracy is correct / count over its every example, so its
        correct answers are that times its size, rounded (exact)."""
        splits = self.program.dataset.splits
        sizes = {e: len(splits[e]["out"]) for e in self.program.train_envs}
        correct = sum(round(results[f"env{e}_out_acc"] * n) for e, n in sizes.items())
        return correct / sum(sizes.values())


def averaging_name(members: Sequence[Member], selection: str) -> str:
    """``methods.AVERAGINGS``' name of the soup: Model Ratatouille's where members
    started from auxiliary runs' featurizers (``init_featurizer_from``; some of its
    members start from the pretrained one, ModelRatatouille's ``get_featurizer_aux``
    index 0), else DiWA's."""
    ratatouille = any(m.config.get("init_featurizer_from") for m in members)
    return f"{'ratatouille' if ratatouille else 'diwa'}_{selection}"


def soup_label(members: Sequence[Member], selection: str) -> str:
    """The soup's row: ``methods.averaging_label`` of the members' row (their method, as
    ``collect_results`` names it, with " + SWAD" for SWAD weights) and the averaging. The
    members must share their method."""
    from sagm_jax import methods
    from sagm_jax.results.records import method_name

    rows = {m.path: method_name(dict(m.record, config=m.config)) for m in members}
    if len(set(rows.values())) > 1:
        listed = "; ".join(f"{path}: {row}" for path, row in rows.items())
        raise ValueError(
            f"the members train different methods ({listed}); a soup's row in the tables "
            "is one method's: average runs of one method."
        )
    return methods.averaging_label(rows[members[0].path], averaging_name(members, selection))


def make_soup(workdirs: Sequence[str], out: str, selection: str = "uniform",
              weights: str = "best", say: Callable[[str], Any] = print) -> dict:
    """Averages the finished runs ``workdirs`` (:func:`members_of`) by ``selection``
    (``uniform`` or ``greedy``), evaluates the soup on every split part and
    writes it as the run directory ``out`` (:func:`write_combined_run`). Returns its
    record, whose ``soup`` holds the ``selection``, the ``weights``, the ``members``
    (:meth:`Member.fingerprint`, in the order given), the greedy ``order`` (member
    indices), the ``accepted`` ones and, for greedy, the ``decisions``: each candidate's
    member, merged validation accuracy, acceptance and test accuracies."""
    import jax

    if selection not in SELECTIONS:
        raise ValueError(f"--selection {selection!r}: expected one of {', '.join(SELECTIONS)}.")
    members = members_of(workdirs, weights)
    label = soup_label(members, selection)
    statistics = _Statistics(members)
    evaluate = _Evaluation(members, statistics)
    order = list(range(len(members)))
    if selection == "uniform":
        state = evaluate.prepare(uniform_soup(members, statistics))
        accepted, decisions = order, None
    else:
        sums, best, tests = _PrefixSums(members, statistics), {}, []

        def accuracy_of(candidate):
            state = evaluate.prepare(sums.mean(candidate))
            results = evaluate(state, evaluate.candidate_parts)
            tests.append({f"env{e}_in_acc": results[f"env{e}_in_acc"]
                          for e in evaluate.program.test_envs})  # diwa.py prints it too
            accuracy = evaluate.merged_validation(results)
            if accuracy >= best.get("accuracy", -float("inf")):  # the rule's acceptance
                best.update(accuracy=accuracy, state=state)
            return accuracy

        chosen = greedy_selection([m.score for m in members], accuracy_of, say)
        order, accepted, state = chosen["order"], chosen["accepted"], best["state"]
        decisions = [
            {"member": i, "accuracy": a, "accepted": i in accepted, "test": t}
            for i, a, t in zip(order, chosen["accuracies"], tests)
        ]
    results = evaluate(state, evaluate.every_part)
    variables = jax.device_get({"params": state.params, "batch_stats": state.batch_stats})
    record = _soup_record(evaluate, members, out, results)
    record["soup"] = {
        "selection": selection,
        "weights": weights,
        "members": [m.fingerprint() for m in members],
        "order": order,
        "accepted": accepted,
        **({"decisions": decisions} if decisions is not None else {}),
    }
    return write_combined_run(out, label, members, record, variables)


def _soup_record(evaluate: _Evaluation, members: Sequence[Member], out: str,
                 results: dict) -> dict:
    """The soup's record: its step is the members' latest, its ``loss`` the training
    environments' mean ``out`` loss (as SWAD's model's record; a soup has no training
    loss)."""
    from sagm_jax.averaging.swad import validation_loss

    program = evaluate.program
    return rundir.make_record(
        members[0].config, out,
        step=max(m.step for m in members),
        loss=validation_loss(results, program.train_envs),
        accuracies=results,
        test_envs=program.test_envs,
        smallest_env=min(len(program.dataset.splits[e]["in"]) for e in program.train_envs),
    )


def report(record: dict, members: Sequence[dict]) -> str:
    """The members' and the soup's test accuracies (the test environments' ``in``
    parts) and training-domain validation, one line each."""
    test_envs = record["args"]["test_envs"]

    def line(name, r):
        tests = "  ".join(f"env{e} {100 * r[f'env{e}_in_acc']:5.1f}" for e in test_envs)
        train = [int(k[3:].split("_")[0]) for k in r if k.endswith("_out_acc")]
        score = validation_accuracy(r, [e for e in train if e not in test_envs])
        return f"  {name:<48} validation {100 * score:5.1f}   test {tests}"

    soup = record["soup"]
    lines = [(f"{record['algorithm']}: the {soup['weights']} weights of "
              f"{len(soup['accepted'])} of {len(members)} members:")]
    for k, member in enumerate(members):
        kept = "" if k in soup["accepted"] else " (left out)"
        lines.append(line(f"member {k}: {member['path']}{kept}", member["record"]))
    lines.append(line(f"soup: {record['args']['output_dir']}", record))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.averaging.soups", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="The soup's run directory.")
    parser.add_argument("--selection", choices=SELECTIONS, default="uniform")
    parser.add_argument("--weights", choices=WEIGHTS, default="best")
    parser.add_argument("runs", nargs="+", help="The members' finished run directories.")
    args = parser.parse_args(argv)
    try:
        record = make_soup(args.runs, args.out, args.selection, args.weights)
    except (FileNotFoundError, ValueError) as error:
        print(f"soups: {error}", file=sys.stderr)
        return 2
    members = [
        {"path": m["path"], "record": _member_record(m)} for m in record["soup"]["members"]
    ]
    print(report(record, members))
    return 0


def _member_record(fingerprint: dict) -> dict:
    """The record of a member's chosen weights (its selected step's, or SWAD's)."""
    if fingerprint["weights"] == "swad":
        return rundir.read_swad_record(fingerprint["path"])
    records = rundir.read_records(fingerprint["path"])
    return next(r for r in records if r["step"] == fingerprint["step"])


if __name__ == "__main__":
    sys.exit(main())
