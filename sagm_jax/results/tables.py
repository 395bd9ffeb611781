"""Statistics and rendering of the result tables: cells (:func:`mean_and_se`,
:class:`Sweep`), Table 2's significance arrows, the rows' and columns' order, cell
formatting and the Markdown/LaTeX tables (Tables 1, 2, 3 and one per dataset).

Tables (accuracy in %):
  * Table 1: rows = methods, columns = datasets and their average. A dataset's
    entry, per trial seed, is the mean over its test environments; the cell is the
    mean +- standard error over trial seeds, where (as DomainBed's
    ``collect_results.format_mean``) s.e. = ``np.std(x) / sqrt(n)``, i.e. the
    population std (ddof=0). A seed counts only when every test environment of
    the dataset has a selected run for it. The paper's rows are followed by the
    averagings across runs (DiWA's and Model Ratatouille's soups, EoA, ERM++), each
    "<member> + <averaging>" row after its averaging's, with their published averages.
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

import collections
import warnings

import numpy as np
import scipy.stats

from sagm_jax import methods
from sagm_jax.data.registry import PAPER_DATASETS, env_label  # the tables' columns
from sagm_jax.results.records import MIXSTYLE, SWAD

ERM = methods.method_label("erm", "erm")  # the reference row of Table 2's arrows
# The paper's order of the update rules in Tables 1 and 3 (a test checks that it names
# exactly the heads of sagm_jax.methods), and Table 3's ablation rows.
HEAD_ORDER = ("sam", "gsam", "erm_sam", "sagm")
ABLATION_ALGORITHMS = ("erm", "sam", "erm_sam", "sagm")
# The objectives that the paper's Table 2 pairs with ERM ("ERM + Mixup", "ERM + CutMix");
# the other objectives follow the procedures, as DomainBed's rows.
TABLE_2_OBJECTIVES = ("mixup", "cutmix")


# The rows of the averagings across runs of ERM runs (``methods.averaging_label``) with
# the published variants (``methods.AVERAGING_PUBLISHED``: DiWA's and Ratatouille's
# uniform, greedy and "3 splits" soups, EoA, ERM++); "<member> + <averaging>" rows of
# other members follow their averaging's row.
AVERAGING_ROWS = tuple(methods.AVERAGING_PUBLISHED)


def _row_order() -> tuple[str, ...]:
    """Every method row, in the paper's order: ERM, its Table 2 objectives and MixStyle,
    the procedures, DomainBed's other objectives, the heads (each followed by its
    MixStyle row), then the heads' combinations with objectives, then DISAM's rows,
    then the averagings' (:data:`AVERAGING_ROWS`): each label from
    ``methods.method_label``, each combination one that ``methods.combination_problem``
    accepts."""
    label = methods.method_label
    others = [o for o in methods.OBJECTIVES if o not in ("erm", *TABLE_2_OBJECTIVES)]
    rows = [label("erm", "erm"), *(label(o, "erm") for o in TABLE_2_OBJECTIVES)]
    rows.append(label("erm", "erm") + MIXSTYLE)
    rows += [label("erm", p) for p in methods.rule_names("procedure")]
    rows += [label(o, "erm") for o in others]
    rows += [name for h in HEAD_ORDER for name in (label("erm", h), label("erm", h) + MIXSTYLE)]
    for disam in (0.0, 1.0):
        rows += [
            label(o, h, disam)
            for h in HEAD_ORDER
            for o in methods.OBJECTIVES
            if (o != "erm" or disam) and methods.combination_problem(o, h, disam) is None
        ]
    return tuple(rows) + AVERAGING_ROWS


ROW_ORDER = _row_order()
# The rows of the paper's Table 1 (Wang et al. 2023), in its order: by published average,
# the sharpness-aware rules last. Each is ``(objective, update rule)``; MixStyle's row is
# ERM's with the MixStyle suffix. The averagings' rows follow (:data:`AVERAGING_ROWS`).
_TABLE_1 = (
    ("mmd", "erm"), "mixstyle", ("groupdro", "erm"), ("irm", "erm"), ("arm", "erm"),
    ("vrex", "erm"), ("erm", "cdann"), ("erm", "and_mask"), ("erm", "dann"), ("rsc", "erm"),
    ("mtl", "erm"), ("mixup", "erm"), ("erm", "mldg"), ("erm", "erm"), ("erm", "fish"),
    ("erm", "sagnet"), ("selfreg", "erm"), ("coral", "erm"), ("erm", "mdsdi"),
    ("miro", "erm"), ("erm", "sam"), ("erm", "gsam"), ("erm", "sagm"),
)
TABLE_1_ROWS = tuple(
    ERM + MIXSTYLE if row == "mixstyle" else methods.method_label(*row) for row in _TABLE_1
) + AVERAGING_ROWS
# The rows of the paper's Table 2, shown with "-" when the sweep has no runs of them.
TABLE_2_ROWS = (
    *ROW_ORDER[: ROW_ORDER.index(ERM + MIXSTYLE) + 1],
    *(methods.method_label("erm", p) for p in ("fish", "and_mask", "mldg")),
    *(methods.method_label("erm", h) for h in ("sam", "gsam", "sagm")),
    methods.method_label("erm", "sagm") + MIXSTYLE,
)
SIGNIFICANCE = 0.05  # Table 2's arrows: Welch's two-sided t-test against ERM, p < this
ARROWS = {False: ("↑", "↓"), True: ("$\\uparrow$", "$\\downarrow$")}  # by latex
PLUS_MINUS = ("±", "+/-")  # ours; DomainBed's collect_results

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


def averaging_of(name: str) -> str | None:
    """The averaging row (:data:`AVERAGING_ROWS`) that row ``name`` is an averaging of
    other members by ("SAGM + DiWA (uniform)": "DiWA (uniform)"), else None."""
    return next((row for row in AVERAGING_ROWS if name.endswith(" + " + row)), None)


def method_order(name: str):
    """Sort key of the rows: ``ROW_ORDER``'s; a MixStyle row not listed there follows its
    method; a "<member> + <averaging>" row follows its averaging's row; other names
    (DomainBed's) come last, alphabetically; a "+ SWAD" row comes right after its
    method's row."""
    averaging = averaging_of(name)
    if averaging is not None:
        return (ROW_ORDER.index(averaging), 2, name, False)
    swad = name.endswith(SWAD)
    name = name[: -len(SWAD)] if swad else name
    base = name[: -len(MIXSTYLE)] if name.endswith(MIXSTYLE) else name
    if name in ROW_ORDER:
        return (ROW_ORDER.index(name), 0, name, swad)
    if base in ROW_ORDER:
        return (ROW_ORDER.index(base), 1, name, swad)
    return (len(ROW_ORDER), 0, name, swad)


def table_1_order(name: str):
    """Sort key of Table 1's rows: the paper's rows in its order (``TABLE_1_ROWS``), each
    followed by its MixStyle and "+ SWAD" rows, an averaging's row by those of other
    members' ("SAGM + DiWA (uniform)"); then the other rows by :func:`method_order`."""
    averaging = averaging_of(name)
    if averaging is not None:
        return (0, TABLE_1_ROWS.index(averaging), 2, name)
    swad = name.endswith(SWAD)
    base = name[: -len(SWAD)] if swad else name
    mixstyle = base.endswith(MIXSTYLE) and base not in TABLE_1_ROWS
    method = base[: -len(MIXSTYLE)] if mixstyle else base
    if method in TABLE_1_ROWS:
        return (0, TABLE_1_ROWS.index(method), mixstyle, swad)
    return (1, method_order(name))


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


# --- Tables --------------------------------------------------------------------


def comparison_table(title: str, ood: Sweep, methods, latex: bool, pm: str,
                     published=None) -> str:
    """Rows = ``methods``, columns = datasets (each its per-seed mean over test
    environments) and their average: Tables 1 and 3; ``published(method) -> text`` adds
    a last column "Published avg"."""
    rows = []
    for method in methods:
        cells = [ood.dataset_cell(d, method) for d in ood.datasets]
        rows.append(
            [method, *[format_cell(c, latex, pm) for c in cells], format_average(cells, latex)]
            + ([published(method)] if published else [])
        )
    header = ["Algorithm", *ood.datasets, "Avg"] + (["Published avg"] if published else [])
    return render_table(title, header, rows, latex)


def table_1(ood: Sweep, name: str, latex: bool, pm: str) -> str:
    """Every row of the paper's Table 1 in its order ("-" without runs), then the sweep's
    other methods, each with its published average over the five DomainBed datasets
    and its source (``methods.published``; the README's methods table gives each
    dataset's figure)."""
    title = f"Table 1: out-of-domain accuracy (%), model selection: {name}"
    published = methods.published()
    rows = sorted(set(TABLE_1_ROWS) | set(ood.methods), key=table_1_order)
    return comparison_table(
        title, ood, rows, latex, pm,
        published=lambda m: methods.published_text(published.get(m), average_only=True),
    )


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
