"""Results tables of a sweep: reads every run under a folder (``rundir.find_runs``),
selects models (``sagm_jax.results.selection``) and prints the paper's tables in Markdown or LaTeX.

    python -m sagm_jax.collect_results --input_dir sweeps/digits \
        [--selection training_domain|leave_one_out|oracle_last|oracle_best] \
        [--latex] [--pm +/-] [--winners] [--output FILE]
    python -m sagm_jax.collect_results --top_hparams --input_dir sweeps/digits \
        --dataset RotatedDigits --algorithm "SAGM + CORAL" --test_env 0

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
``config.mixstyle``. Rows follow the paper's order (:data:`ROW_ORDER`). Inside a
group, a hyperparameter SETTING is the run's whole config except ``test_envs`` and
``all_test_envs``, so the single run (t,) and the pair runs (t, v) of one setting
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

Which setting won: ``--winners`` adds, per dataset, a table of the chosen setting of
each (method, test environment, trial seed): its accuracies, the hyperparameters that
vary between the settings of that cell (:func:`varying_keys`) and its folder.
``--top_hparams`` (:func:`top_hparams`) prints every setting of one (dataset, method,
test environment) ranked, as DomainBed's ``list_top_hparams`` does.

Tables (accuracy in %):
  * Table 1: rows = methods, columns = datasets and their average. A dataset's
    entry, per trial seed, is the mean over its test environments; the cell is the
    mean +- standard error over trial seeds, where (as DomainBed's
    ``collect_results.format_mean``) s.e. = ``np.std(x) / sqrt(n)``, i.e. the
    population std (ddof=0). A seed counts only when every test environment of
    the dataset has a selected run for it.
  * one table per dataset, each test environment a column (mean +- s.e. over seeds);
  * Table 2: in-domain (``split="in_domain"`` runs, ``selection.in_domain_run``)
    next to out-of-domain (Table 1's entry) for every dataset with in-domain runs;
    every row of the paper's Table 2 (ERM, ERM + Mixup, ERM + CutMix, ERM + MixStyle,
    Fish, AND-mask, MLDG, SAM, GSAM, SAGM, SAGM + MixStyle), then the sweep's other
    methods; "↑" / "↓" beside a cell whose per-seed values differ from ERM's at
    p < 0.05 by Welch's two-sided t-test (:func:`significance_arrow`);
  * Table 3: the ablation rows ERM, SAM, ERM + SAM, SAGM (and "+ MixStyle" variants;
    no "+ SWAD" rows).
A cell with no runs is "-"; a cell over fewer trial seeds than the dataset has in the
sweep shows "(k/n)"; an average including such a cell shows "(partial)". Under
leave-one-domain-out, a table without any entry for lack of pair runs is replaced by
a line saying so, and a note lists the methods without pair runs with the sweep
command that adds them (``--test_envs all_with_pairs``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys
import warnings

import numpy as np
import scipy.stats

from sagm_jax import methods
from sagm_jax.training import rundir
from sagm_jax.results import selection
from sagm_jax.data.registry import PAPER_DATASETS, env_label  # the tables' columns
from sagm_jax.sweep.jobs import ARGS

MIXSTYLE = " + MixStyle"
SWAD = " + SWAD"  # the row of a method's SWAD models (swad_runs)
# A SWAD record's step in its run of the "+ SWAD" row: one step for every SWAD model, so
# that leave-one-domain-out pairs the single run's SWAD model with the pair runs' (their
# valleys may end at different steps; the averaged range is in the record's "swad").
SWAD_STEP = 0
ERM = methods.method_label("erm", "erm")  # the reference row of Table 2's arrows
# The paper's order of the update rules in Tables 1 and 3 (a test checks that it names
# exactly the heads of sagm_jax.methods), and Table 3's ablation rows.
HEAD_ORDER = ("sam", "gsam", "erm_sam", "sagm")
ABLATION_ALGORITHMS = ("erm", "sam", "erm_sam", "sagm")
# The objectives that the paper's Table 2 pairs with ERM ("ERM + Mixup", "ERM + CutMix");
# the other objectives follow the procedures, as DomainBed's rows.
TABLE_2_OBJECTIVES = ("mixup", "cutmix")


def _row_order() -> tuple[str, ...]:
    """Every method row, in the paper's order: ERM, its Table 2 objectives and MixStyle,
    the procedures, DomainBed's other objectives, the heads (each followed by its
    MixStyle row), then the heads' combinations with objectives, then DISAM's rows:
    each label from ``methods.method_label``, each combination one that
    ``methods.combination_problem`` accepts."""
    label = methods.method_label
    others = [o for o in methods.OBJECTIVES if o not in ("erm", *TABLE_2_OBJECTIVES)]
    rows = [label("erm", "erm"), *(label(o, "erm") for o in TABLE_2_OBJECTIVES)]
    rows.append(label("erm", "erm") + MIXSTYLE)
    rows += [label("erm", p) for p in methods.PROCEDURES]
    rows += [label(o, "erm") for o in others]
    rows += [name for h in HEAD_ORDER for name in (label("erm", h), label("erm", h) + MIXSTYLE)]
    for disam in (0.0, 1.0):
        rows += [
            label(o, h, disam)
            for h in HEAD_ORDER
            for o in methods.OBJECTIVES
            if (o != "erm" or disam) and methods.combination_problem(o, h, disam) is None
        ]
    return tuple(rows)


ROW_ORDER = _row_order()
# The rows of the paper's Table 2, shown with "-" when the sweep has no runs of them.
TABLE_2_ROWS = (
    *ROW_ORDER[: ROW_ORDER.index(ERM + MIXSTYLE) + 1],
    *(methods.method_label("erm", p) for p in methods.PROCEDURES),
    *(methods.method_label("erm", h) for h in ("sam", "gsam", "sagm")),
    methods.method_label("erm", "sagm") + MIXSTYLE,
)
SIGNIFICANCE = 0.05  # Table 2's arrows: Welch's two-sided t-test against ERM, p < this
ARROWS = {False: ("↑", "↓"), True: ("$\\uparrow$", "$\\downarrow$")}  # by latex
NOT_TEST_KEYS = ("test_envs", "all_test_envs")  # what differs between runs of one setting
DOMAINBED = " (DomainBed)"  # marks the methods of records written by DomainBed
DOMAINBED_STEPS = 5001  # DomainBed's N_STEPS when a run leaves --steps unset
PLUS_MINUS = ("±", "+/-")  # ours; DomainBed's collect_results


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


# --- Cells ---------------------------------------------------------------------

Cell = collections.namedtuple("Cell", "mean se n expected")  # mean, se in %; n seeds


def mean_and_se(values, expected: int) -> Cell | None:
    if not values:
        return None
    x = 100 * np.asarray(values, dtype=np.float64)
    return Cell(float(np.mean(x)), float(np.std(x) / np.sqrt(len(x))), len(x), expected)


class Sweep:
    """The selected accuracies of one split, with what the sweep should contain."""

    def __init__(self, chosen: dict, groups: dict, split: str):
        self.acc = {k[1:]: v for k, v in chosen.items() if k[0] == split}
        # A test environment of the sweep is one that some single-test-env run holds out
        # (pair runs also join the group of their second environment).
        keys = [
            k[1:]
            for k, settings in groups.items()
            if k[0] == split and any((k[-1],) in runs for runs in settings.values())
        ]
        self.datasets = sorted({k[0] for k in keys}, key=dataset_order)
        self.seeds = {d: sorted({k[2] for k in keys if k[0] == d}) for d in self.datasets}
        self.test_envs = {d: sorted({k[3] for k in keys if k[0] == d}) for d in self.datasets}
        self.methods = sorted({k[1] for k in keys}, key=method_order)

    def env_cell(self, dataset, method, env) -> Cell | None:
        values = [
            self.acc[dataset, method, s, env]
            for s in self.seeds[dataset]
            if (dataset, method, s, env) in self.acc
        ]
        return mean_and_se(values, len(self.seeds[dataset]))

    def per_seed(self, dataset, method) -> list[float]:
        """Per trial seed, the mean over ALL the dataset's test environments; seeds
        missing one of them are left out."""
        values = []
        for seed in self.seeds.get(dataset, []):
            accs = [self.acc.get((dataset, method, seed, env)) for env in self.test_envs[dataset]]
            if None not in accs:
                values.append(float(np.mean(accs)))
        return values

    def dataset_cell(self, dataset, method) -> Cell | None:
        """The mean and s.e. of :meth:`per_seed` (incomplete seeds are not averaged in:
        the cell then shows how many seeds it has)."""
        return mean_and_se(self.per_seed(dataset, method), len(self.seeds.get(dataset, [])))


def significance_arrow(values, reference, latex: bool) -> str:
    """Table 2's mark of a cell whose per-seed ``values`` differ significantly from ERM's
    ``reference``: Welch's two-sided t-test (unequal variances),

        t = (mean(x) - mean(y)) / sqrt(var(x)/n_x + var(y)/n_y)   (var with ddof 1),

    with Welch-Satterthwaite degrees of freedom (``scipy.stats.ttest_ind(equal_var=
    False)``); "↑" (higher) or "↓" (lower) when p < ``SIGNIFICANCE``, else "". It needs
    at least 2 seeds on both sides; equal constant samples give no p (NaN) and no arrow."""
    if len(values) < 2 or len(reference) < 2:
        return ""
    with warnings.catch_warnings():  # constant samples: scipy warns and returns NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        p = scipy.stats.ttest_ind(values, reference, equal_var=False).pvalue
    if not p < SIGNIFICANCE:
        return ""
    up, down = ARROWS[latex]
    return up if np.mean(values) > np.mean(reference) else down


def dataset_order(name: str):
    return (
        (PAPER_DATASETS.index(name), "") if name in PAPER_DATASETS else (len(PAPER_DATASETS), name)
    )


def method_order(name: str):
    """Sort key of the rows: ``ROW_ORDER``'s; a MixStyle row not listed there follows its
    method; other names (DomainBed's) come last, alphabetically; a "+ SWAD" row comes
    right after its method's row."""
    swad = name.endswith(SWAD)
    name = name[: -len(SWAD)] if swad else name
    base = name[: -len(MIXSTYLE)] if name.endswith(MIXSTYLE) else name
    if name in ROW_ORDER:
        return (ROW_ORDER.index(name), 0, name, swad)
    if base in ROW_ORDER:
        return (ROW_ORDER.index(base), 1, name, swad)
    return (len(ROW_ORDER), 0, name, swad)


def format_cell(cell: Cell | None, latex: bool, pm: str = PLUS_MINUS[0]) -> str:
    """``mean pm s.e.`` (``$\\pm$`` in LaTeX), with ``(k/n)`` when seeds are missing."""
    if cell is None:
        return "-"
    sign = "$\\pm$" if latex else pm
    text = f"{cell.mean:.1f} {sign} {cell.se:.1f}"
    return text + (f" ({cell.n}/{cell.expected})" if cell.n < cell.expected else "")


def format_average(cells: list, latex: bool) -> str:
    """The mean of the entries (DomainBed's "Avg": no error bar); "-" if any is missing."""
    if not cells or any(c is None for c in cells):
        return "-"
    partial = any(c.n < c.expected for c in cells)
    return f"{np.mean([c.mean for c in cells]):.1f}" + (" (partial)" if partial else "")


# --- Rendering -----------------------------------------------------------------


def latex_escape(text: str) -> str:
    for char in "\\&%$#_{}":
        text = text.replace(char, "\\" + char)
    return text


def render_table(
    title: str, header: list[str], rows: list[list[str]], latex: bool, note: str = ""
) -> str:
    """A Markdown or LaTeX table; ``note`` (already in the target's markup) follows it."""
    if latex:
        lines = [
            "\\begin{table}[h]",
            "\\centering",
            f"\\caption{{{latex_escape(title)}}}",
            "\\begin{tabular}{l" + "c" * (len(header) - 1) + "}",
            "\\toprule",
            " & ".join(latex_escape(h) for h in header) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join([latex_escape(row[0]), *row[1:]]) + " \\\\" for row in rows]
        lines += ["\\bottomrule", "\\end{tabular}"]
        lines += [f"\\par\\smallskip{{\\footnotesize {note}}}"] if note else []
        lines.append("\\end{table}")
    else:
        lines = [
            f"### {title}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["", note] if note else []
    return "\n".join(lines)


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


# --- Tables --------------------------------------------------------------------


def comparison_table(title: str, ood: Sweep, methods, latex: bool, pm: str) -> str:
    """Rows = ``methods``, columns = datasets (each its per-seed mean over test
    environments) and their average: Tables 1 and 3."""
    rows = []
    for method in methods:
        cells = [ood.dataset_cell(d, method) for d in ood.datasets]
        rows.append(
            [method, *[format_cell(c, latex, pm) for c in cells], format_average(cells, latex)]
        )
    return render_table(title, ["Algorithm", *ood.datasets, "Avg"], rows, latex)


def table_1(ood: Sweep, name: str, latex: bool, pm: str) -> str:
    title = f"Table 1: out-of-domain accuracy (%), model selection: {name}"
    return comparison_table(title, ood, ood.methods, latex, pm)


def dataset_table(ood: Sweep, dataset: str, env_names, name: str, latex: bool, pm: str) -> str:
    """One dataset: a column per test environment, then the dataset's entry."""
    envs = ood.test_envs[dataset]
    header = ["Algorithm", *[env_label(dataset, e, env_names) for e in envs], "Avg"]
    rows = [
        [
            method,
            *[format_cell(ood.env_cell(dataset, method, e), latex, pm) for e in envs],
            format_cell(ood.dataset_cell(dataset, method), latex, pm),
        ]
        for method in ood.methods
    ]
    title = f"{dataset}: accuracy (%) per test environment, model selection: {name}"
    return render_table(title, header, rows, latex)


def table_2(in_domain: Sweep, ood: Sweep, name: str, latex: bool, pm: str) -> str:
    """In-domain next to out-of-domain accuracy, for each dataset with in-domain runs:
    the paper's rows (``TABLE_2_ROWS``, "-" without runs), then every other method
    with runs. A cell is marked by :func:`significance_arrow` against ERM's seeds."""
    header = ["Algorithm"]
    for dataset in in_domain.datasets:
        header += [f"{dataset} in-domain", f"{dataset} out-of-domain"]
    swept = set(in_domain.methods) | set(ood.methods)
    rows = []
    for method in sorted(swept | set(TABLE_2_ROWS), key=method_order):
        row = [method]
        for dataset in in_domain.datasets:
            for sweep in (in_domain, ood):
                values = sweep.per_seed(dataset, method) if dataset in sweep.seeds else []
                expected = len(sweep.seeds.get(dataset, []))
                text = format_cell(mean_and_se(values, expected), latex, pm)
                if method != ERM and values:
                    reference = sweep.per_seed(dataset, ERM)
                    text = f"{text} {significance_arrow(values, reference, latex)}".rstrip()
                row.append(text)
        rows.append(row)
    title = (
        "Table 2: in-domain (60/20/20 split, training-domain validation) vs out-of-domain "
        f"accuracy (%), out-of-domain model selection: {name}"
    )
    up, down = ARROWS[latex]
    note = (
        f"higher / lower than ERM's at p < {SIGNIFICANCE:g} by Welch's two-sided t-test "
        "(unequal variances; scipy.stats.ttest_ind, equal_var=False) over the "
        "per-trial-seed values of the cell, with at least 2 trial seeds on both sides."
    )
    if latex:
        note = latex_escape(note).replace("p < ", "$p<$ ")
    return render_table(title, header, rows, latex, f"{up} / {down}: {note}")


def table_3(ood: Sweep, name: str, latex: bool, pm: str) -> str:
    """The ablation rows, with the MixStyle variants of the sweep."""
    ablation = [methods.method_label("erm", a) for a in ABLATION_ALGORITHMS]
    ablation += [m for m in ood.methods if m.endswith(MIXSTYLE)]
    title = f"Table 3: ablation, out-of-domain accuracy (%), model selection: {name}"
    return comparison_table(title, ood, sorted(ablation, key=method_order), latex, pm)


def report_notes(name, pm, finished, sweeps, incomplete, not_started) -> list[str]:
    """What the cells mean, test environments missing from a dataset, and the runs
    left out."""
    notes = [
        f"Model selection: {name}. Cells: mean {pm} standard error over trial seeds, "
        "s.e. = np.std(x, ddof=0) / sqrt(n) (DomainBed's); a dataset's entry averages "
        "its test environments per seed; '-' = no runs; (k/n) = over k of the n trial "
        "seeds of that dataset in the sweep; (partial) = an average including such a cell."
    ]
    n_envs = {
        r.records[0]["args"]["dataset"]: sum(
            1 for k in r.records[0] if k.startswith("env") and k.endswith("_out_acc")
        )
        for r in finished
    }
    for sweep, kind in zip(sweeps, ("out-of-domain", "in-domain")):
        for dataset in sweep.datasets:
            if len(sweep.test_envs[dataset]) < n_envs[dataset]:
                notes.append(
                    f"{dataset} ({kind}): test environments "
                    f"{', '.join(map(str, sweep.test_envs[dataset]))} only, of {n_envs[dataset]}."
                )
    if incomplete:
        notes.append("Incomplete runs (no 'done'; left out): " + ", ".join(incomplete) + ".")
    if not_started:
        notes.append("Jobs without records (not started): " + ", ".join(sorted(not_started)) + ".")
    return notes


def missing_pair_runs(groups: dict, split: str = "domainbed") -> dict:
    """``{(dataset, method): [test environments]}`` where a trial seed has the single run
    (t,) but no setting with every pair run (t, v) that leave-one-domain-out needs
    (``selection.leave_one_out_run`` finds no step)."""
    missing = collections.defaultdict(set)
    for (group_split, dataset, method, _, t), settings in groups.items():
        singles = [runs for runs in settings.values() if (t,) in runs]
        if group_split == split and singles:
            if all(selection.leave_one_out_run(runs, t) is None for runs in singles):
                missing[dataset, method].add(t)
    return {key: sorted(envs) for key, envs in missing.items()}


def pair_runs_command(runs: list[Run], missing: dict, input_dir: str) -> str:
    """The sweep command that adds the pair runs of the ``missing`` (dataset, method)
    pairs of our runs (``--test_envs all_with_pairs``; the done single runs are skipped).
    The sweep's other arguments (``--hparams``, ``--grid``, ``--set``) are not in the
    records' methods, so the command says to add them."""
    axes = {k: [] for k in ("datasets", "algorithms", "objectives", "disam_lambdas", "seeds")}
    for run in runs:
        first = run.records[0]
        if is_domainbed(first) or (first["args"]["dataset"], method_name(first)) not in missing:
            continue
        objective, algorithm, disam = method_of(first)
        args = first["args"]
        values = (args["dataset"], algorithm, objective, disam, args["trial_seed"])
        for key, value in zip(axes, values):
            if value not in axes[key]:
                axes[key].append(value)
    order = {  # each axis in its table's order
        "datasets": dataset_order,
        "algorithms": list(methods.UPDATE_RULES).index,
        "objectives": list(methods.OBJECTIVES).index,
    }
    axes = {k: sorted(v, key=order.get(k)) for k, v in axes.items()}
    words = ["python", "-m", "sagm_jax.sweep", "launch", "--datasets", *axes["datasets"]]
    words += ["--algorithms", *axes["algorithms"]]
    if axes["objectives"] != ["erm"]:
        words += ["--objectives", *axes["objectives"]]
    if axes["disam_lambdas"] != [0.0]:
        words += ["--disam_lambdas", *(f"{v:g}" for v in axes["disam_lambdas"])]
    words += ["--trial_seeds", *(str(s) for s in axes["seeds"])]
    words += ["--test_envs", "all_with_pairs", "--output_dir", input_dir]
    return shlex.join(words) + " <the sweep's --hparams, --grid and --set>"


def missing_pairs_note(missing: dict, ood: Sweep, command: str) -> str:
    """Leave-one-domain-out's note: which methods lack pair runs, and how to add them."""
    parts = []
    for dataset in ood.datasets:
        entries = [
            f"{method} (test environments {', '.join(map(str, missing[dataset, method]))})"
            for method in ood.methods
            if (dataset, method) in missing
        ]
        if entries:
            parts.append(f"{dataset}: " + ", ".join(entries))
    note = (
        "Leave-one-domain-out needs, beside each single run (t,), the pair runs (t, v) "
        "holding out t and each other environment v; missing for " + "; ".join(parts) + ". "
        f"Add them with: {command} (jobs already done are skipped)."
    )
    if any(method.endswith(DOMAINBED) for _, method in missing):
        note += " DomainBed's runs: its sweep.py without --single_test_envs."
    return note


def no_entry_text(title: str, latex: bool) -> str:
    """What stands in place of a table that leave-one-domain-out leaves without entries."""
    text = (
        "No entry: the sweep has no pair runs that leave-one-domain-out can use here "
        "(the notes say which are missing and how to add them)."
    )
    return f"% {latex_escape(f'{title}: {text}')}" if latex else f"### {title}\n\n{text}"


def check_options(selection_name: str, pm: str) -> None:
    if pm not in PLUS_MINUS:
        raise ValueError(f"--pm {pm!r}: expected one of {', '.join(PLUS_MINUS)}.")
    if selection_name not in selection.RUN_SELECTIONS:
        raise ValueError(
            f"--selection {selection_name!r}: expected one of "
            f"{', '.join(selection.RUN_SELECTIONS)}."
        )


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


def build_report(
    input_dir: str,
    selection_name: str = "training_domain",
    latex: bool = False,
    pm: str = PLUS_MINUS[0],
    winners: bool = False,
) -> str:
    """The whole report (tables and notes) as one string; ``pm``: "±", or "+/-" as
    DomainBed prints (LaTeX always uses $\\pm$); ``winners``: after the tables, which
    setting won each cell (:func:`winners_table`)."""
    check_options(selection_name, pm)
    loaded = load_sweep(input_dir)
    finished, groups = loaded.finished, loaded.groups
    choices = select_settings(groups, selection_name)
    chosen = {group: choice["test_acc"] for group, choice in choices.items()}
    ood, in_domain = Sweep(chosen, groups, "domainbed"), Sweep(chosen, groups, "in_domain")
    name = selection.SELECTION_NAMES[selection_name]
    missing = missing_pair_runs(groups) if selection_name == "leave_one_out" else {}
    # Under leave-one-domain-out, a table or a dataset without any entry is a missing-
    # runs message, not a table of dashes.
    has_entry = {d for (d, *_) in ood.acc} if missing else set(ood.datasets)
    labels = env_labels(finished, input_dir)
    out = []
    if ood.datasets:
        out.append(table_1(ood, name, latex, pm) if has_entry else no_entry_text("Table 1", latex))
        for d in ood.datasets:
            table = dataset_table(ood, d, labels.get(d), name, latex, pm)
            out.append(table if d in has_entry else no_entry_text(d, latex))
    if in_domain.datasets:
        out.append(table_2(in_domain, ood, name, latex, pm))
    if ood.datasets:
        out.append(table_3(ood, name, latex, pm) if has_entry else no_entry_text("Table 3", latex))
    for split, sweep in (("domainbed", ood), ("in_domain", in_domain)) if winners else ():
        out += [
            winners_table(loaded, choices, split, d, labels.get(d), name, latex)
            for d in sweep.datasets
            if any(g[:2] == (split, d) for g in choices)
        ]
    left_out = (loaded.incomplete, loaded.not_started)
    notes = report_notes(name, pm, finished, (ood, in_domain), *left_out)
    if missing:
        command = pair_runs_command(finished, missing, input_dir)
        notes.append(missing_pairs_note(missing, ood, command))
    if latex:
        out += ["% " + latex_escape(n).replace(pm, "$\\pm$") for n in notes]
    else:
        out += ["Notes:", "\n".join(f"- {n}" for n in notes)]
    return "\n\n".join(out) + "\n"


# --- Which setting won ---------------------------------------------------------


def setting_hparams(runs: dict) -> dict:
    """The hyperparameters of a setting (``{test_envs: records}``): what
    ``rundir.hyperparameters`` keeps of our config, or the ``hparams`` of DomainBed's
    records."""
    first = next(iter(runs.values()))[0]
    if is_domainbed(first):
        return dict(first.get("hparams", {}))
    return rundir.hyperparameters(first["config"])


def varying_keys(hparams: list[dict]) -> list[str]:
    """The keys, sorted, whose value is not the same in every dict of ``hparams`` (a key
    that some dict lacks varies)."""
    keys = sorted(set().union(*hparams)) if hparams else []

    def value(h, k):
        return json.dumps(h[k], sort_keys=True, default=str) if k in h else None

    return [k for k in keys if len({value(h, k) for h in hparams}) > 1]


def winner_text(settings: dict, key: str) -> str:
    """The hyperparameters of setting ``key`` that vary between the ``settings`` of its
    cell, ``"dropout=0.1, lr=3e-05"``."""
    if len(settings) == 1:
        return "(the only setting)"
    hparams = {k: setting_hparams(runs) for k, runs in settings.items()}
    varying = varying_keys(list(hparams.values()))
    if not varying:
        return "(no hyperparameter differs)"
    return ", ".join(f"{k}={hparams[key].get(k, '(unset)')}" for k in varying)


def winners_table(loaded, choices: dict, split: str, dataset: str, env_names, name, latex) -> str:
    """Which setting each (method, test environment, trial seed) cell of ``dataset`` took:
    its validation and test accuracy (%), the hyperparameters that vary within the cell
    (:func:`winner_text`) and the folder of its single-test-environment run."""
    cells = sorted(
        (g for g in choices if g[:2] == (split, dataset)),
        key=lambda g: (method_order(g[2]), g[4], g[3]),
    )
    rows = []
    for group in cells:
        _, _, method, seed, t = group
        choice = choices[group]
        text = [
            env_label(dataset, t, env_names),
            str(seed),
            f"{100 * choice['val_acc']:.1f}",
            f"{100 * choice['test_acc']:.1f}",
            winner_text(loaded.groups[group], choice["setting"]),
            loaded.where[group, choice["setting"], (t,)],
        ]
        rows.append([method, *(latex_escape(x) if latex else x for x in text)])
    header = ["Algorithm", "Test env", "Trial seed", "Validation", "Test"]
    header += ["Hyperparameters that vary", "Folder"]
    if split == "in_domain":
        title = f"{dataset} in-domain (Table 2): the chosen setting of each cell"
    else:
        title = f"{dataset}: the chosen setting of each cell, model selection: {name}"
    return render_table(title, header, rows, latex)


# --- Ranked settings (DomainBed's list_top_hparams) ----------------------------

TOP_HPARAMS_SELECTIONS = ("training_domain", "leave_one_out", "oracle_last")  # DomainBed's


def top_hparams(input_dir: str, dataset: str, algorithm: str, test_env: int) -> str:
    """Every setting of ``dataset``, ``algorithm`` and test environment ``test_env``
    ranked as DomainBed's ``list_top_hparams`` ranks them: the number of records, then
    for each selection of :data:`TOP_HPARAMS_SELECTIONS` and each trial seed, the
    settings by validation accuracy, best first (ties as :func:`tie_order`), each with
    its validation and test accuracy, its hyperparameters sorted by key ("*" marks
    those that differ between the settings of the trial seed) and its runs' folders.
    Only finished out-of-domain runs are ranked. ``algorithm`` is a row label
    ("SAGM + CORAL", "SAGM + SWAD", "ERM (DomainBed)"), or a recorded
    ``args.algorithm`` ("sagm", DomainBed's "ERM"), which ranks each row of its runs."""
    loaded = load_sweep(input_dir)
    rows = rows_of(loaded.groups, dataset, algorithm, test_env)
    names = env_labels(loaded.finished, input_dir).get(dataset)
    lines = [
        f"Total records: {sum(len(r.records) for r in loaded.runs)}",
        f"Runs: {len(loaded.finished)} finished, {len(loaded.incomplete)} incomplete (not "
        "ranked)" + (f"; {len(loaded.swad)} of them with a SWAD record" if loaded.swad else ""),
        f"Dataset {dataset}, test environment {env_label(dataset, test_env, names)}, "
        f"rows: {', '.join(rows)}",
        "hparams marked * differ between the settings of their trial seed.",
    ]
    for row in rows:
        lines += row_ranking(loaded, dataset, row, test_env)
    return "\n".join(lines) + "\n"


def rows_of(groups: dict, dataset: str, algorithm: str, test_env: int) -> list[str]:
    """The rows that ``--algorithm`` names on ``dataset`` (:func:`top_hparams`), checked
    to have single runs holding out ``test_env``."""
    ood = {g: s for g, s in groups.items() if g[0] == "domainbed" and g[1] == dataset}
    if not ood:
        datasets = sorted({g[1] for g in groups if g[0] == "domainbed"}, key=dataset_order)
        raise ValueError(
            f"--dataset {dataset}: no finished out-of-domain runs; datasets: "
            f"{', '.join(datasets)}."
        )
    labels = sorted({g[2] for g in ood}, key=method_order)
    recorded = collections.defaultdict(set)  # row -> its runs' args.algorithm
    for (_, _, row, _, _), settings in ood.items():
        recorded[row] |= {next(iter(r.values()))[0]["args"]["algorithm"] for r in settings.values()}
    rows = [algorithm] if algorithm in labels else [r for r in labels if algorithm in recorded[r]]
    if not rows:
        names = sorted(set().union(*recorded.values()))
        raise ValueError(
            f"--algorithm {algorithm!r}: no finished runs on {dataset}; rows: "
            f"{', '.join(labels)}; recorded algorithms: {', '.join(names)}."
        )
    envs = {g[4] for g, s in ood.items() if g[2] in rows and any((g[4],) in r for r in s.values())}
    if test_env not in envs:
        raise ValueError(
            f"--test_env {test_env}: no run of {', '.join(rows)} on {dataset} holds it out; "
            f"test environments: {', '.join(map(str, sorted(envs)))}."
        )
    return rows


def row_ranking(loaded, dataset: str, row: str, test_env: int) -> list[str]:
    """:func:`top_hparams`'s lines for one row."""
    lines = ["", f"=== {row} ==="]
    seeds = sorted(g[3] for g in loaded.groups if g[:3] == ("domainbed", dataset, row))
    seeds = [s for s in seeds if ("domainbed", dataset, row, s, test_env) in loaded.groups]
    for selection_name in TOP_HPARAMS_SELECTIONS:
        lines += ["", f"Model selection: {selection.SELECTION_NAMES[selection_name]}"]
        for seed in sorted(set(seeds)):
            group = ("domainbed", dataset, row, seed, test_env)
            settings = dict(sorted(loaded.groups[group].items(), key=tie_order))
            run_selection = selection.RUN_SELECTIONS[selection_name]
            ranked = selection.rank_settings(run_selection, settings, test_env)
            hparams = {key: setting_hparams(runs) for key, runs in settings.items()}
            varying = set(varying_keys(list(hparams.values())))
            lines.append(f"  trial_seed: {seed}")
            if not ranked:
                lines.append("    (no setting has the runs this selection needs)")
            for rank, choice in enumerate(ranked, 1):
                key = choice["setting"]
                paths = {envs: loaded.where[group, key, envs] for envs in settings[key]}
                lines += setting_lines(rank, choice, settings[key], hparams[key], varying, paths)
    return lines


def setting_lines(rank, choice, runs, hparams, varying, paths) -> list[str]:
    """One ranked setting: its accuracies (and ``args.hparams_seed``), hyperparameters
    (``*`` where they vary) and the folders of its runs (``paths``: ``{test_envs: path}``),
    the single run first."""
    seed = next(iter(runs.values()))[0]["args"].get("hparams_seed")
    head = f"    {rank}. val_acc {choice['val_acc']:.4f}, test_acc {choice['test_acc']:.4f}"
    lines = [head + (f" (hparams_seed {seed})" if seed is not None else ""), "        hparams:"]
    lines += [
        f"        {'*' if k in varying else ' '} {k}: {v}"
        for k, v in sorted(hparams.items())
    ]
    lines.append("        output_dirs:")
    lines += [
        f"          {path} (test envs {', '.join(map(str, envs))})"
        for envs, path in sorted(paths.items(), key=lambda item: (len(item[0]), item[0]))
    ]
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.collect_results", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--input_dir", required=True, help="A sweep's output folder.")
    parser.add_argument(
        "--selection",
        default="training_domain",
        help=f"One of {', '.join(selection.RUN_SELECTIONS)}.",
    )
    parser.add_argument("--latex", action="store_true", help="LaTeX tables instead of Markdown.")
    parser.add_argument(
        "--pm",
        choices=PLUS_MINUS,
        default=PLUS_MINUS[0],
        help="The sign between mean and standard error; '+/-' is DomainBed's style.",
    )
    parser.add_argument(
        "--winners",
        action="store_true",
        help="After the tables, per dataset, the setting that each cell chose: its "
        "hyperparameters that vary within the cell and its folder.",
    )
    top = parser.add_argument_group("--top_hparams (instead of the tables)")
    top.add_argument(
        "--top_hparams",
        action="store_true",
        help="Rank every setting of --dataset, --algorithm and --test_env under each "
        "selection and trial seed, as DomainBed's list_top_hparams does.",
    )
    top.add_argument("--dataset", help="A dataset of the sweep (PACS).")
    top.add_argument(
        "--algorithm",
        help='A row label of the tables ("SAGM + CORAL", "SAGM + SWAD", "ERM (DomainBed)"), '
        'or a recorded algorithm name (config.algorithm "sagm", DomainBed\'s "ERM"): a '
        "name ranks each row of its runs separately.",
    )
    top.add_argument("--test_env", type=int, help="The held-out environment's index.")
    parser.add_argument("--output", help="Write the report to this file (default: stdout).")
    return parser


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    top_args = (args.dataset, args.algorithm, args.test_env)
    if args.top_hparams and None in top_args:
        parser.error("--top_hparams needs --dataset, --algorithm and --test_env.")
    if not args.top_hparams and top_args != (None, None, None):
        parser.error("--dataset, --algorithm and --test_env go with --top_hparams.")
    try:
        if args.top_hparams:
            report = top_hparams(args.input_dir, *top_args)
        else:
            report = build_report(args.input_dir, args.selection, args.latex, args.pm, args.winners)
    except (FileNotFoundError, ValueError) as error:
        print(f"collect_results: {error}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(report)
    else:
        sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
