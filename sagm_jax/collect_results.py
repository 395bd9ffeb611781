"""Results tables of a sweep: reads every run under a folder (``rundir.find_runs``),
selects models (``sagm_jax.selection``) and prints the paper's tables in Markdown or LaTeX.

    python -m sagm_jax.collect_results --input_dir sweeps/digits \
        [--selection training_domain|leave_one_out|oracle_last|oracle_best] \
        [--latex] [--pm +/-] [--output FILE]

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
  * Table 3: the ablation rows ERM, SAM, ERM + SAM, SAGM (and "+ MixStyle" variants).
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

from sagm_jax import methods, rundir, selection
from sagm_jax.data.registry import PAPER_DATASETS, env_label  # the tables' columns
from sagm_jax.sweep.jobs import ARGS

MIXSTYLE = " + MixStyle"
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
                "(written by sagm_jax.train) nor 'args.hparams_seed' (written by "
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
    """The row of a record: ``methods.method_label`` (+ " + MixStyle"), or DomainBed's
    ``args.algorithm`` + " (DomainBed)"."""
    if is_domainbed(record):
        return f"{record['args']['algorithm']}{DOMAINBED}"
    objective, algorithm, disam = method_of(record)
    if objective in methods.OBJECTIVES and algorithm in methods.UPDATE_RULES:
        label = methods.method_label(objective, algorithm, disam)
    else:  # a name this version does not know: shown as recorded
        label = algorithm if objective == "erm" else f"{algorithm} + {objective}"
    return label + (MIXSTYLE if record["config"].get("mixstyle") else "")


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


def group_runs(runs: list[Run]) -> dict:
    """``{(split, dataset, method, trial_seed, t): {setting: {test_envs: records}}}``."""
    groups = collections.defaultdict(dict)
    where = {}
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
    written by DomainBed or by ``sagm_jax.train`` has ``args.hparams_seed``; records
    without it (which DomainBed cannot read) come last, by setting key."""
    key, runs = item
    seed = next(iter(runs.values()))[0]["args"].get("hparams_seed")
    return (0, -int(seed), key) if seed is not None else (1, 0, key)


def select(groups: dict, selection_name: str) -> dict:
    """``{(split, dataset, method, trial_seed, t): test accuracy}`` of the chosen models;
    in-domain groups are scored by ``selection.in_domain_run``. Ties between settings
    are broken as DomainBed's reader breaks them (:func:`tie_order`); within a run,
    the earliest of equal checkpoints wins (DomainBed's ``argmax`` too)."""
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
            chosen[group] = choice["test_acc"]
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
    method; other names (DomainBed's) come last, alphabetically."""
    base = name[: -len(MIXSTYLE)] if name.endswith(MIXSTYLE) else name
    if name in ROW_ORDER:
        return (ROW_ORDER.index(name), 0, name)
    if base in ROW_ORDER:
        return (ROW_ORDER.index(base), 1, name)
    return (len(ROW_ORDER), 0, name)


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


def build_report(
    input_dir: str,
    selection_name: str = "training_domain",
    latex: bool = False,
    pm: str = PLUS_MINUS[0],
) -> str:
    """The whole report (tables and notes) as one string; ``pm``: "±", or "+/-" as
    DomainBed prints (LaTeX always uses $\\pm$)."""
    check_options(selection_name, pm)
    runs, not_started = load_runs(input_dir)
    finished = [r for r in runs if r.done]
    incomplete = sorted(r.path for r in runs if not r.done)
    if not finished:
        raise ValueError(
            f"--input_dir {input_dir}: no finished run (no 'done' file); "
            f"incomplete: {', '.join(incomplete)}."
        )
    groups = group_runs(finished)
    chosen = select(groups, selection_name)
    ood, in_domain = Sweep(chosen, groups, "domainbed"), Sweep(chosen, groups, "in_domain")
    name = selection.SELECTION_NAMES[selection_name]
    missing = missing_pair_runs(groups) if selection_name == "leave_one_out" else {}
    # Under leave-one-domain-out, a table or a dataset without any entry is a missing-
    # runs message, not a table of dashes.
    has_entry = {d for (d, *_) in ood.acc} if missing else set(ood.datasets)
    out = []
    if ood.datasets:
        labels = env_labels(finished, input_dir)
        out.append(table_1(ood, name, latex, pm) if has_entry else no_entry_text("Table 1", latex))
        for d in ood.datasets:
            table = dataset_table(ood, d, labels.get(d), name, latex, pm)
            out.append(table if d in has_entry else no_entry_text(d, latex))
    if in_domain.datasets:
        out.append(table_2(in_domain, ood, name, latex, pm))
    if ood.datasets:
        out.append(table_3(ood, name, latex, pm) if has_entry else no_entry_text("Table 3", latex))
    notes = report_notes(name, pm, finished, (ood, in_domain), incomplete, not_started)
    if missing:
        command = pair_runs_command(finished, missing, input_dir)
        notes.append(missing_pairs_note(missing, ood, command))
    if latex:
        out += ["% " + latex_escape(n).replace(pm, "$\\pm$") for n in notes]
    else:
        out += ["Notes:", "\n".join(f"- {n}" for n in notes)]
    return "\n\n".join(out) + "\n"


def main(argv=None) -> int:
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
    parser.add_argument("--output", help="Write the report to this file (default: stdout).")
    args = parser.parse_args(argv)
    try:
        report = build_report(args.input_dir, args.selection, args.latex, args.pm)
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
