"""Reading a sweep's runs and records, ours and DomainBed's (:func:`load_runs`,
:func:`load_sweep`), the method and setting of a record, grouping (:func:`group_runs`)
and the glue to ``sagm_jax.results.selection`` that picks each group's setting
(:func:`select_settings`).

Records written by DomainBed's ``train.py`` (no ``config``; ``args.hparams_seed``) are
read too, so our sweeps and DomainBed's published ones can share a table: their
method is ``args.algorithm`` + " (DomainBed)", their hyperparameter setting is
``args.hparams_seed``, and a DomainBed run counts as finished when it has ``done``
or its last record is step ``args.steps - 1`` (5000 when ``steps`` is unset). A run
killed while it wrote a record keeps its records but the torn last line (dropped with
a warning, as a resumed run drops it); without ``done`` it is listed as incomplete.
Our runs' records are checked against their config's evaluation steps as they are read
(``rundir.check_steps``); DomainBed's records (no config) are not checked so. A damaged
run (a lost or repeated record, a line that is not a record, records of neither kind, a
SWAD record without its keys, or a second run with the same setting and test
environments) never enters a table: it is left out and named with the reason
(:func:`load_sweep`'s ``left_out``), or, with ``strict``, it is an error naming the file.
Two runs of one setting and test environments are told apart by their data: the dataset
fingerprint of their ``split.json`` (``data_dir`` is no hyperparameter, so the same
config on other data is named as such, not as a duplicate). A run with ``done`` and no
records lost them (``lost``), which the report says; it is not a job that never started.

Grouping (DomainBed's ``reporting.get_grouped_records``): a run's records join the
group (split, dataset, method, trial_seed, t) for each of its test environments t.
The METHOD is ``methods.method_label(objective, algorithm, disam_lambda)`` ("SAGM",
"ERM + Mixup", "CORAL", "DISAM on SAGM + CORAL"; records without ``objective`` or
``disam_lambda``, written before they existed, are erm and 0), plus " + MixStyle" when
``config.mixstyle``, read from the config (:func:`method_of`): ``args.algorithm`` holds
the label DomainBed's collector shows (``rundir.record_algorithm``), and held the update
rule in records written before. Rows follow the paper's order
(:data:`sagm_jax.results.tables.ROW_ORDER`). Inside a group, a hyperparameter
SETTING is the run's whole config except ``test_envs`` and ``all_test_envs``, so the single run (t,) and the pair runs (t, v) of one setting
meet, which leave-one-domain-out needs. Runs without ``done`` are left out of the
tables and listed in a note. Of settings with equal validation accuracy, the one with
the largest ``args.hparams_seed`` is chosen, as DomainBed's reader chooses.

SWAD: a finished run with a SWAD record (``rundir.SWAD_RESULTS``: one record of the
averaged model, with the keys of a results.jsonl record and ``"swad"``) also gives a
run of the row "<method> + SWAD" whose only record is that one (:func:`swad_runs`),
placed right after its method's row. Its settings are chosen among the SWAD records
by the same rules, so a cell is the test environment's ``in`` accuracy of the SWAD
model of the setting whose SWAD model has the best mean training-environment ``out``
accuracy (the oracles: the best test-environment ``out`` accuracy; leave-one-domain-out:
the pair runs' SWAD models). Runs without a SWAD record give no "+ SWAD" row.
"""

from __future__ import annotations

import collections
import json
import os

from sagm_jax import methods
from sagm_jax.data import splits
from sagm_jax.training import rundir
from sagm_jax.results import selection
from sagm_jax.sweep.jobs import ARGS

MIXSTYLE = rundir.MIXSTYLE
SWAD = " + SWAD"  # the row of a method's SWAD models (swad_runs)
# A SWAD record's step in its run of the "+ SWAD" row: one step for every SWAD model, so
# that leave-one-domain-out pairs the single run's SWAD model with the pair runs' (their
# valleys may end at different steps; the averaged range is in the record's "swad").
SWAD_STEP = 0
NOT_TEST_KEYS = ("test_envs", "all_test_envs")  # what differs between runs of one setting
DOMAINBED = " (DomainBed)"  # marks the methods of records written by DomainBed
DOMAINBED_STEPS = 5001  # DomainBed's N_STEPS when a run leaves --steps unset


Run = collections.namedtuple("Run", "path done records")  # path relative to the input


def load_runs(input_dir: str, left_out: list | None = None) -> tuple[list[Run], list, list]:
    """Every run under ``input_dir`` with records, the job folders without records (a
    sweep's job that never started, or a run that has not evaluated yet) and the
    finished runs without records (``done``, but results.jsonl empty or missing: their
    records were lost). A damaged run (:func:`records_problem`) is an error, or, given a
    ``left_out`` list, is appended there as ``(path, why)`` and left out."""
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"--input_dir {input_dir}: no such directory.")
    damaged = None if left_out is None else []
    found = rundir.find_runs(input_dir, damaged)
    runs, not_started, lost = [], [], []
    for run in found:
        path = os.path.relpath(run.path, input_dir)
        problem = records_problem(run.records)
        if problem and left_out is None:
            raise ValueError(f"{os.path.join(run.path, rundir.RESULTS)}: {problem}")
        if problem:
            left_out.append((path, problem))
        elif run.records:
            runs.append(Run(path, run.done or domainbed_finished(run.records), run.records))
        else:
            (lost if run.done else not_started).append(path)
    for folder, error in damaged or []:
        left_out.append((os.path.relpath(folder, input_dir), error))
    run_folders = {
        os.path.normpath(f) for f in [r.path for r in found] + [f for f, _ in damaged or []]
    }
    for folder, _, files in os.walk(input_dir):
        if ARGS in files and os.path.normpath(folder) not in run_folders:
            not_started.append(os.path.relpath(folder, input_dir))
    if not runs:
        why = "; ".join(f"{path}: {problem}" for path, problem in left_out or [])
        raise ValueError(
            f"--input_dir {input_dir}: no results.jsonl with records under it"
            + (f" (left out: {why})." if why else ".")
        )
    return runs, sorted(not_started), sorted(lost)


def records_problem(records: list[dict]) -> str | None:
    """Why a run's records cannot be read as ours or DomainBed's, or None."""
    for record in records:
        if "args" not in record or not ("config" in record or "hparams_seed" in record["args"]):
            return (
                "a record has neither 'config' (written by sagm_jax.training.train) nor "
                "'args.hparams_seed' (written by DomainBed's train.py); expected records of "
                "one of them."
            )
    return None


def domainbed_finished(records: list[dict]) -> bool:
    """A DomainBed run without ``done`` finished when its last record is its last step."""
    return (
        is_domainbed(records[0])
        and max(r["step"] for r in records)
        == (records[0]["args"].get("steps") or DOMAINBED_STEPS) - 1
    )


def is_domainbed(record: dict) -> bool:
    """Written by DomainBed's train.py (it keeps no ``config``)."""
    return "config" not in record


def method_of(record: dict) -> tuple[str, str, float]:
    """``(objective, algorithm, disam_lambda)`` of one of our records, from its config;
    records written before objectives and DISAM existed have neither: ``erm`` and 0. A
    config without ``algorithm`` takes the update rule from ``args.algorithm``, which held
    it before records wrote the method's label there (``rundir.record_algorithm``); a
    label found there is read back as its method (:func:`method_of_label`)."""
    config = record["config"]
    objective, disam = config.get("objective", "erm"), float(config.get("disam_lambda") or 0)
    if "algorithm" in config:
        return objective, config["algorithm"], disam
    recorded = record["args"]["algorithm"]
    if recorded in methods.UPDATE_RULES:
        return objective, recorded, disam
    return method_of_label(recorded) or (objective, recorded, disam)


def method_of_label(label: str) -> tuple[str, str, float] | None:
    """The ``(objective, algorithm, disam_lambda)`` whose ``rundir.record_algorithm`` is
    ``label`` (without " + MixStyle"; DISAM's lambda as 1.0), or None."""
    label = label.removesuffix(MIXSTYLE).removesuffix(rundir.MIXSTYLE2)
    for objective in methods.OBJECTIVES:
        for algorithm in methods.UPDATE_RULES:
            for disam in (0.0, 1.0):
                config = {"objective": objective, "algorithm": algorithm, "disam_lambda": disam}
                if rundir.record_algorithm(config) == label:
                    return objective, algorithm, disam
    return None


def recorded_algorithm(record: dict) -> str:
    """The update rule of one of our records (``config.algorithm``), or DomainBed's
    ``args.algorithm``: what ``--top_hparams --algorithm`` matches besides a row."""
    return record["args"]["algorithm"] if is_domainbed(record) else method_of(record)[1]


def method_name(record: dict) -> str:
    """The row of a record: ``methods.method_label`` (+ " + MixStyle"; + " + SWAD" for a
    SWAD record, which has ``"swad"``), or DomainBed's ``args.algorithm`` + " (DomainBed)";
    a combined run's (a soup, an ensemble) is its label (``rundir.combined_label``)."""
    if is_domainbed(record):
        return f"{record['args']['algorithm']}{DOMAINBED}"
    if rundir.combined_label(record):  # a soup's or an ensemble's (sagm_jax.averaging)
        return rundir.combined_label(record)
    objective, algorithm, disam = method_of(record)
    if objective in methods.OBJECTIVES and algorithm in methods.UPDATE_RULES:
        label = methods.method_label(objective, algorithm, disam)
    else:  # a name this version does not know: shown as recorded
        label = algorithm if objective == "erm" else f"{algorithm} + {objective}"
    label += rundir.mixstyle_suffix(record["config"])
    return label + (SWAD if "swad" in record else "")


def swad_runs(runs: list[Run], input_dir: str, left_out: list | None = None) -> list[Run]:
    """The runs of the "+ SWAD" rows: for each finished run with a SWAD record
    (``rundir.read_swad_record``), a run at the same path whose one record is that
    record with ``step`` set to :data:`SWAD_STEP` (:func:`method_name` names its row). A
    SWAD record without its keys is an error, or, given a ``left_out`` list, is appended
    there as ``(path of swad.jsonl, why)`` and left out (its run's records stay)."""
    found = []
    for run in runs:
        record = rundir.read_swad_record(os.path.join(input_dir, run.path)) if run.done else None
        if record is None:
            continue
        if not {"swad", "args", "config"} <= set(record):
            problem = (
                "the SWAD record lacks 'swad', 'args' or 'config'; expected the record that "
                "sagm_jax.training.train writes for the SWAD model."
            )
            if left_out is None:
                raise ValueError(
                    f"{os.path.join(input_dir, run.path, rundir.SWAD_RESULTS)}: {problem}"
                )
            left_out.append((os.path.join(run.path, rundir.SWAD_RESULTS), problem))
            continue
        found.append(Run(run.path, True, [{**record, "step": SWAD_STEP}]))
    return found


def setting_key(record: dict) -> str:
    """The run's hyperparameter setting: its config without the test environments and the
    settings that do not change the result (``rundir.result_free_keys``), or DomainBed's
    ``args.hparams_seed``."""
    if is_domainbed(record):
        return json.dumps({"domainbed_hparams_seed": record["args"]["hparams_seed"]})
    config = record["config"]
    ignored = set(NOT_TEST_KEYS) | set(rundir.result_free_keys(config))
    return json.dumps({k: v for k, v in config.items() if k not in ignored}, sort_keys=True)


def split_of(record: dict) -> str:
    return "domainbed" if is_domainbed(record) else record["config"].get("split", "domainbed")


def group_runs(
    runs: list[Run],
    where: dict | None = None,
    left_out: list | None = None,
    input_dir: str | None = None,
) -> dict:
    """``{(split, dataset, method, trial_seed, t): {setting: {test_envs: records}}}``;
    ``where``, when given, receives ``{(group, setting, test_envs): run path}``. A run
    with the same setting and test environments as an earlier one (in ``runs``' order)
    is an error, or, given a ``left_out`` list, is appended there as ``(path, why)`` and
    left out; ``input_dir``, where the runs are, lets :func:`duplicate_problem` compare
    their data."""
    groups = collections.defaultdict(dict)
    where = {} if where is None else where
    for run in runs:
        first = run.records[0]
        args = first["args"]
        test_envs = tuple(sorted(int(e) for e in args["test_envs"]))
        split, setting = split_of(first), setting_key(first)
        cells = [
            (split, args["dataset"], method_name(first), int(args["trial_seed"]), t)
            for t in test_envs
        ]
        taken = [where[c, setting, test_envs] for c in cells if (c, setting, test_envs) in where]
        if taken:
            problem = duplicate_problem(input_dir, taken[0], run.path)
            if left_out is None:
                raise ValueError(f"runs {taken[0]} and {run.path} {problem}")
            left_out.append((run.path, f"{problem} (kept: {taken[0]})"))
            continue
        for cell in cells:
            groups[cell].setdefault(setting, {})[test_envs] = run.records
            where[cell, setting, test_envs] = run.path
    return groups


def duplicate_problem(input_dir: str | None, kept: str, other: str) -> str:
    """What two runs of one setting and test environments are: the same run twice, or,
    when their ``split.json`` fingerprints differ (``rundir.read_data_fingerprint``), the
    same config trained on different data. Runs without a split record (DomainBed's, or
    written before it) count as the same data."""
    prints = [
        rundir.read_data_fingerprint(os.path.join(input_dir, path)) if input_dir else None
        for path in (kept, other)
    ]
    changes = splits.fingerprint_changes(*prints) if None not in prints else []
    if changes:
        return (
            "have the same config and test environments but were trained on different "
            f"data ({'; '.join(changes)}); a table compares runs on one dataset: move one "
            "out of the input folder."
        )
    return "have the same config, test environments and data; remove one."


def tie_order(item: tuple) -> tuple:
    """Sort key of a group's ``(setting key, runs)`` items, such that of settings with
    equal validation accuracy the FIRST is the one DomainBed's reader picks.

    DomainBed (``model_selection.SelectionMethod.hparams_accs``) groups a test
    environment's records by ``args.hparams_seed`` in sorted order (``Q.group``),
    stable-sorts the settings by ``val_acc`` and reverses the list, so of equal
    ``val_acc`` the LARGEST ``args.hparams_seed`` wins. ``selection.sweep_selection``
    keeps the first of equal settings, hence the descending order. Every record
    written by DomainBed or by ``sagm_jax.training.train`` has ``args.hparams_seed``; records
    without it (which DomainBed cannot read) come last, by setting key."""
    key, runs = item
    seed = next(iter(runs.values()))[0]["args"].get("hparams_seed")
    return (0, -int(seed), key) if seed is not None else (1, 0, key)


def select(groups: dict, selection_name: str) -> dict:
    """``{(split, dataset, method, trial_seed, t): test accuracy}`` of the chosen models
    (:func:`select_settings`)."""
    chosen = select_settings(groups, selection_name)
    return {group: choice["test_acc"] for group, choice in chosen.items()}


def select_settings(groups: dict, selection_name: str) -> dict:
    """``{(split, dataset, method, trial_seed, t): {"step", "val_acc", "test_acc",
    "setting"}}`` of the chosen models; in-domain groups are scored by
    ``selection.in_domain_run``. Ties between settings are broken as DomainBed's reader
    breaks them (:func:`tie_order`); within a run, the earliest of equal checkpoints
    wins (DomainBed's ``argmax`` too)."""
    if selection_name not in selection.RUN_SELECTIONS:
        raise ValueError(
            f"--selection {selection_name!r}: expected one of "
            f"{', '.join(selection.RUN_SELECTIONS)}."
        )
    chosen = {}
    for group, settings in groups.items():
        run_selection = (
            selection.in_domain_run
            if group[0] == "in_domain"
            else selection.RUN_SELECTIONS[selection_name]
        )
        settings = dict(sorted(settings.items(), key=tie_order))
        choice = selection.sweep_selection(run_selection, settings, group[-1])
        if choice is not None:
            chosen[group] = choice
    return chosen


def env_labels(runs: list[Run], input_dir: str) -> dict:
    """``{dataset: [env names]}`` from the runs' ``run_info.json`` (written by the
    training loop); ``env{i}`` where none is found."""
    labels = {}
    for run in runs:
        dataset = run.records[0]["args"]["dataset"]
        folder = os.path.join(input_dir, run.path)
        if dataset not in labels and os.path.exists(os.path.join(folder, rundir.RUN_INFO)):
            labels[dataset] = rundir.read_run_info(folder).get("env_names")
    return {d: names for d, names in labels.items() if names}


# A sweep as read by load_sweep.
Loaded = collections.namedtuple(
    "Loaded", "runs finished incomplete not_started swad groups where lost left_out"
)


def load_sweep(input_dir: str, strict: bool = False):
    """Every run under ``input_dir`` (``runs``), the ``finished`` ones, the paths of the
    ``incomplete`` ones, the jobs ``not_started``, the runs of the SWAD records
    (:func:`swad_runs`), and the ``groups`` of the finished runs and the SWAD records
    with ``where`` each run is (:func:`group_runs`); the finished runs whose records
    were ``lost``, and the ``left_out`` runs, ``[(path, why)]``: damaged records
    (:func:`load_runs`), a SWAD record without its keys, a second run of one setting
    and test environments (:func:`group_runs`). ``strict``: each of those is an error."""
    left_out = None if strict else []
    runs, not_started, lost = load_runs(input_dir, left_out)
    finished = [r for r in runs if r.done]
    incomplete = sorted(r.path for r in runs if not r.done)
    if not finished:
        raise ValueError(
            f"--input_dir {input_dir}: no finished run (no 'done' file); "
            f"incomplete: {', '.join(incomplete)}."
        )
    group_runs(finished, left_out=left_out, input_dir=input_dir)  # finds the duplicates
    dropped = {path for path, _ in left_out or []}
    finished = [r for r in finished if r.path not in dropped]
    where, swad = {}, swad_runs(finished, input_dir, left_out)
    groups = group_runs(finished + swad, where, left_out, input_dir)
    left_out = sorted(left_out or [])
    return Loaded(runs, finished, incomplete, not_started, swad, groups, where, lost, left_out)
