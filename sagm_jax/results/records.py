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
(``rundir.check_steps``): a lost or repeated record is an error naming the file and the
steps, never a table built on it; DomainBed's records (no config) are not checked so.

Grouping (DomainBed's ``reporting.get_grouped_records``): a run's records join the
group (split, dataset, method, trial_seed, t) for each of its test environments t.
The METHOD is ``methods.method_label(objective, algorithm, disam_lambda)`` ("SAGM",
"ERM + Mixup", "CORAL", "DISAM on SAGM + CORAL"; records without ``objective`` or
``disam_lambda``, written before they existed, are erm and 0), plus " + MixStyle" when
``config.mixstyle``. Rows follow the paper's order
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
from sagm_jax.training import rundir
from sagm_jax.results import selection
from sagm_jax.sweep.jobs import ARGS

MIXSTYLE = " + MixStyle"
SWAD = " + SWAD"  # the row of a method's SWAD models (swad_runs)
# A SWAD record's step in its run of the "+ SWAD" row: one step for every SWAD model, so
# that leave-one-domain-out pairs the single run's SWAD model with the pair runs' (their
# valleys may end at different steps; the averaged range is in the record's "swad").
SWAD_STEP = 0
NOT_TEST_KEYS = ("test_envs", "all_test_envs")  # what differs between runs of one setting
DOMAINBED = " (DomainBed)"  # marks the methods of records written by DomainBed
DOMAINBED_STEPS = 5001  # DomainBed's N_STEPS when a run leaves --steps unset


Run = collections.namedtuple("Run", "path done records")  # path relative to the input


def load_runs(input_dir: str) -> tuple[list[Run], list[str]]:
    """Every run under ``input_dir`` with records, and the job folders without records
    (a sweep's job that never started, or a run that has not evaluated yet)."""
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"--input_dir {input_dir}: no such directory.")
    found = rundir.find_runs(input_dir)
    runs, without_records = [], []
    for run in found:
        _check_records(run)
        path = os.path.relpath(run.path, input_dir)
        if run.records:
            runs.append(Run(path, run.done or domainbed_finished(run.records), run.records))
        else:
            without_records.append(path)
    run_folders = {os.path.normpath(run.path) for run in found}
    for folder, _, files in os.walk(input_dir):
        if ARGS in files and os.path.normpath(folder) not in run_folders:
            without_records.append(os.path.relpath(folder, input_dir))
    if not runs:
        raise ValueError(f"--input_dir {input_dir}: no results.jsonl with records under it.")
    return runs, sorted(without_records)


def _check_records(run: rundir.Run) -> None:
    for record in run.records:
        if "args" not in record or not ("config" in record or "hparams_seed" in record["args"]):
            raise ValueError(
                f"{os.path.join(run.path, rundir.RESULTS)}: a record has neither 'config' "
                "(written by sagm_jax.training.train) nor 'args.hparams_seed' (written by "
                "DomainBed's train.py); expected records of one of them."
            )


def domainbed_finished(records: list[dict]) -> bool:
    """A DomainBed run without ``done`` finished when its last record is its last step."""
    return is_domainbed(records[0]) and max(r["step"] for r in records) == (
        records[0]["args"].get("steps") or DOMAINBED_STEPS
    ) - 1


def is_domainbed(record: dict) -> bool:
    """Written by DomainBed's train.py (it keeps no ``config``)."""
    return "config" not in record


def method_of(record: dict) -> tuple[str, str, float]:
    """``(objective, algorithm, disam_lambda)`` of one of our records; records written
    before objectives and DISAM existed have neither: ``erm`` and 0."""
    config = record["config"]
    algorithm = config.get("algorithm", record["args"]["algorithm"])
    return config.get("objective", "erm"), algorithm, float(config.get("disam_lambda") or 0)


def method_name(record: dict) -> str:
    """The row of a record: ``methods.method_label`` (+ " + MixStyle"; + " + SWAD" for a
    SWAD record, which has ``"swad"``), or DomainBed's ``args.algorithm`` + " (DomainBed)"."""
    if is_domainbed(record):
        return f"{record['args']['algorithm']}{DOMAINBED}"
    objective, algorithm, disam = method_of(record)
    if objective in methods.OBJECTIVES and algorithm in methods.UPDATE_RULES:
        label = methods.method_label(objective, algorithm, disam)
    else:  # a name this version does not know: shown as recorded
        label = algorithm if objective == "erm" else f"{algorithm} + {objective}"
    label += MIXSTYLE if record["config"].get("mixstyle") else ""
    return label + (SWAD if "swad" in record else "")


def swad_runs(runs: list[Run], input_dir: str) -> list[Run]:
    """The runs of the "+ SWAD" rows: for each finished run with a SWAD record
    (``rundir.read_swad_record``), a run at the same path whose one record is that
    record with ``step`` set to :data:`SWAD_STEP` (:func:`method_name` names its row)."""
    found = []
    for run in runs:
        record = rundir.read_swad_record(os.path.join(input_dir, run.path)) if run.done else None
        if record is None:
            continue
        if not {"swad", "args", "config"} <= set(record):
            raise ValueError(
                f"{os.path.join(input_dir, run.path, rundir.SWAD_RESULTS)}: the SWAD record "
                "lacks 'swad', 'args' or 'config'; expected the record that sagm_jax.training.train "
                "writes for the SWAD model."
            )
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


def group_runs(runs: list[Run], where: dict | None = None) -> dict:
    """``{(split, dataset, method, trial_seed, t): {setting: {test_envs: records}}}``;
    ``where``, when given, receives ``{(group, setting, test_envs): run path}``."""
    groups = collections.defaultdict(dict)
    where = {} if where is None else where
    for run in runs:
        first = run.records[0]
        args = first["args"]
        test_envs = tuple(sorted(int(e) for e in args["test_envs"]))
        split = split_of(first)
        for t in test_envs:
            group = (split, args["dataset"], method_name(first), int(args["trial_seed"]), t)
            setting = groups[group].setdefault(setting_key(first), {})
            if test_envs in setting:
                raise ValueError(
                    f"runs {where[group, setting_key(first), test_envs]} and {run.path} "
                    "have the same config and test environments; remove one."
                )
            setting[test_envs] = run.records
            where[group, setting_key(first), test_envs] = run.path
    return groups


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
    "Loaded", "runs finished incomplete not_started swad groups where"
)


def load_sweep(input_dir: str):
    """Every run under ``input_dir`` (``runs``), the ``finished`` ones, the paths of the
    ``incomplete`` ones, the jobs ``not_started``, the runs of the SWAD records
    (:func:`swad_runs`), and the ``groups`` of the finished runs and the SWAD records
    with ``where`` each run is (:func:`group_runs`)."""
    runs, not_started = load_runs(input_dir)
    finished = [r for r in runs if r.done]
    incomplete = sorted(r.path for r in runs if not r.done)
    if not finished:
        raise ValueError(
            f"--input_dir {input_dir}: no finished run (no 'done' file); "
            f"incomplete: {', '.join(incomplete)}."
        )
    where, swad = {}, swad_runs(finished, input_dir)
    groups = group_runs(finished + swad, where)
    return Loaded(runs, finished, incomplete, not_started, swad, groups, where)
