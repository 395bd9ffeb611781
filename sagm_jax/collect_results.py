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
The METHOD is the algorithm, plus " + MixStyle" when ``config.mixstyle``. Inside a
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
  * Table 3: the ablation rows ERM, SAM, ERM + SAM, SAGM (and "+ MixStyle" variants).
A cell with no runs is "-"; a cell over fewer trial seeds than the dataset has in the
sweep shows "(k/n)"; an average including such a cell shows "(partial)".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

from sagm_jax import rundir, selection
from sagm_jax.data.registry import PAPER_DATASETS, env_label  # the tables' columns
from sagm_jax.sweep.jobs import ARGS

# The tables' names of sagm_jax.optimizers.ALGORITHMS (a test checks that they name
# exactly those), in the order of the paper's rows.
ALGORITHM_NAMES = {
    "erm": "ERM",
    "sam": "SAM",
    "gsam": "GSAM",
    "erm_sam": "ERM + SAM",
    "sagm": "SAGM",
}
ALGORITHM_ORDER = tuple(ALGORITHM_NAMES)
ABLATION_ALGORITHMS = ("erm", "sam", "erm_sam", "sagm")
MIXSTYLE = " + MixStyle"
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


def method_name(record: dict) -> str:
    algorithm = record["args"]["algorithm"]
    if is_domainbed(record):
        return f"{algorithm}{DOMAINBED}"
    return ALGORITHM_NAMES.get(algorithm, algorithm) + (
        MIXSTYLE if record["config"].get("mixstyle") else ""
    )


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

    def dataset_cell(self, dataset, method) -> Cell | None:
        """Per seed the mean over ALL the dataset's test environments; incomplete seeds
        are not averaged in (the cell then shows how many seeds it has)."""
        per_seed = []
        for seed in self.seeds.get(dataset, []):
            accs = [self.acc.get((dataset, method, seed, env)) for env in self.test_envs[dataset]]
            if None not in accs:
                per_seed.append(np.mean(accs))
        return mean_and_se(per_seed, len(self.seeds.get(dataset, [])))


def dataset_order(name: str):
    return (
        (PAPER_DATASETS.index(name), "") if name in PAPER_DATASETS else (len(PAPER_DATASETS), name)
    )


def method_order(name: str):
    base = name[: -len(MIXSTYLE)] if name.endswith(MIXSTYLE) else name
    algorithm = next((a for a, n in ALGORITHM_NAMES.items() if n == base), None)
    rank = ALGORITHM_ORDER.index(algorithm) if algorithm else len(ALGORITHM_ORDER)
    return (rank, base, name.endswith(MIXSTYLE))


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


def render_table(title: str, header: list[str], rows: list[list[str]], latex: bool) -> str:
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
        lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
    else:
        lines = [
            f"### {title}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
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
    """In-domain next to out-of-domain accuracy, for each dataset with in-domain runs."""
    header, rows = ["Algorithm"], []
    for dataset in in_domain.datasets:
        header += [f"{dataset} in-domain", f"{dataset} out-of-domain"]
    for method in sorted(set(in_domain.methods) | set(ood.methods), key=method_order):
        row = [method]
        for dataset in in_domain.datasets:
            out = ood.dataset_cell(dataset, method) if dataset in ood.seeds else None
            row += [
                format_cell(in_domain.dataset_cell(dataset, method), latex, pm),
                format_cell(out, latex, pm),
            ]
        rows.append(row)
    title = (
        "Table 2: in-domain (60/20/20 split, training-domain validation) vs out-of-domain "
        f"accuracy (%), out-of-domain model selection: {name}"
    )
    return render_table(title, header, rows, latex)


def table_3(ood: Sweep, name: str, latex: bool, pm: str) -> str:
    """The ablation rows, with the MixStyle variants of the sweep."""
    ablation = [ALGORITHM_NAMES[a] for a in ABLATION_ALGORITHMS]
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
    out = []
    if ood.datasets:
        labels = env_labels(finished, input_dir)
        out.append(table_1(ood, name, latex, pm))
        out += [dataset_table(ood, d, labels.get(d), name, latex, pm) for d in ood.datasets]
    if in_domain.datasets:
        out.append(table_2(in_domain, ood, name, latex, pm))
    if ood.datasets:
        out.append(table_3(ood, name, latex, pm))
    notes = report_notes(name, pm, finished, (ood, in_domain), incomplete, not_started)
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
