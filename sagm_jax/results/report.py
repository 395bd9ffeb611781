"""The whole report of ``python -m sagm_jax.collect_results`` (:func:`build_report`):
the tables, the winners' tables when asked, and the notes (what the cells mean, runs
left out, and under leave-one-domain-out the missing pair runs with the commands that
add exactly those, ``sagm_jax.results.pair_jobs``)."""

from __future__ import annotations

import collections

from sagm_jax.results import pair_jobs, selection
from sagm_jax.results.listings import winners_table
from sagm_jax.results.records import (
    DOMAINBED,
    env_labels,
    load_sweep,
    select_settings,
)
from sagm_jax.results.tables import (
    PLUS_MINUS,
    Sweep,
    dataset_table,
    latex_escape,
    table_1,
    table_2,
    table_3,
)


def report_notes(name, pm, finished, sweeps, loaded) -> list[str]:
    """What the cells mean, test environments missing from a dataset, and the runs
    left out (``loaded``: :func:`records.load_sweep`'s)."""
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
    return notes + left_out_notes(loaded)


def left_out_notes(loaded) -> list[str]:
    """The notes of the runs without a place in the tables: incomplete, finished with
    their records lost, not started, and each damaged run with why."""
    notes = []
    if loaded.incomplete:
        notes.append("Incomplete runs (no 'done'; left out): " + ", ".join(loaded.incomplete) + ".")
    if loaded.lost:
        notes.append(
            "Finished runs without records ('done', but results.jsonl is empty or missing: "
            "they finished and lost their records; left out): " + ", ".join(loaded.lost) + "."
        )
    if loaded.not_started:
        notes.append(
            "Jobs without records (not started): " + ", ".join(sorted(loaded.not_started)) + "."
        )
    notes += [
        f"Left out {path} (--strict refuses the report instead): {why}"
        for path, why in loaded.left_out
    ]
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


def missing_pairs_note(needed, ood: Sweep) -> str:
    """Leave-one-domain-out's note: which methods lack pair runs, and the commands that
    launch exactly the missing ones (``needed``: :func:`pair_jobs.missing_pairs`'s)."""
    parts = []
    for dataset in ood.datasets:
        entries = [
            f"{method} (test environments {', '.join(map(str, needed.cells[dataset, method]))})"
            for method in ood.methods
            if (dataset, method) in needed.cells
        ]
        if entries:
            parts.append(f"{dataset}: " + ", ".join(entries))
    note = (
        "Leave-one-domain-out needs, beside each single run (t,), the pair runs (t, v) of "
        "its setting, holding out t and each other environment v; missing for "
        + "; ".join(parts)
        + "."
    )
    lines = pair_jobs.commands(needed.jobs)
    n = len(needed.jobs)
    if len(lines) == 1:
        note += f" Add the {n} missing pair run(s), and no other, with: {lines[0]}"
    elif lines:
        note += (
            f" Add the {n} missing pair runs, and no other, with these {len(lines)} commands "
            "(one per method and setting where one grid cannot hold them):"
        )
        note += "".join(f"\n  {line}" for line in lines)
    if any(method.endswith(DOMAINBED) for _, method in needed.cells):
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
    winners: bool = False,
    strict: bool = False,
) -> str:
    """The whole report (tables and notes) as one string; ``pm``: "±", or "+/-" as
    DomainBed prints (LaTeX always uses $\\pm$); ``winners``: after the tables, which
    setting won each cell (:func:`winners_table`); ``strict``: a damaged run is an error,
    not a run left out and named in the notes (:func:`records.load_sweep`)."""
    check_options(selection_name, pm)
    loaded = load_sweep(input_dir, strict)
    finished, groups = loaded.finished, loaded.groups
    choices = select_settings(groups, selection_name)
    chosen = {group: choice["test_acc"] for group, choice in choices.items()}
    ood, in_domain = Sweep(chosen, groups, "domainbed"), Sweep(chosen, groups, "in_domain")
    name = selection.SELECTION_NAMES[selection_name]
    loo = selection_name == "leave_one_out"
    missing = missing_pair_runs(groups) if loo else {}
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
    notes = report_notes(name, pm, finished, (ood, in_domain), loaded)
    needed = pair_jobs.missing_pairs(loaded, input_dir) if loo else None
    if needed and needed.cells:
        notes.append(missing_pairs_note(needed, ood))
    if latex:
        notes = [latex_escape(n).replace(pm, "$\\pm$") for n in notes]
        out += ["% " + n.replace("\n", "\n% ") for n in notes]  # each line a comment
    else:
        out += ["Notes:", "\n".join(f"- {n}" for n in notes)]
    return "\n\n".join(out) + "\n"
