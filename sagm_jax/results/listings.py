"""Which setting won: ``--winners`` (:func:`winners_table`) and ``--top_hparams``
(:func:`top_hparams`).

Which setting won: ``--winners`` adds, per dataset, a table of the chosen setting of
each (method, test environment, trial seed): its accuracies, the hyperparameters that
vary between the settings of that cell (:func:`varying_keys`) and its folder.
``--top_hparams`` (:func:`top_hparams`) prints every setting of one (dataset, method,
test environment) ranked, as DomainBed's ``list_top_hparams`` does.
"""

from __future__ import annotations

import collections
import json

from sagm_jax.training import rundir
from sagm_jax.results import selection
from sagm_jax.data.registry import env_label
from sagm_jax.results.records import (
    env_labels,
    is_domainbed,
    load_sweep,
    recorded_algorithm,
    tie_order,
)
from sagm_jax.results.tables import dataset_order, latex_escape, method_order, render_table

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
# The config keys of the method, shown for every setting even where they do not vary.
METHOD_KEYS = ("algorithm", "objective", "disam_lambda")


def top_hparams(
    input_dir: str, dataset: str, algorithm: str, test_env: int, strict: bool = False
) -> str:
    """Every setting of ``dataset``, ``algorithm`` and test environment ``test_env``
    ranked as DomainBed's ``list_top_hparams`` ranks them: the number of records, then
    for each selection of :data:`TOP_HPARAMS_SELECTIONS` and each trial seed, the
    settings by validation accuracy, best first (ties as :func:`tie_order`), each with
    its validation and test accuracy, the hyperparameters that differ between the
    settings of the trial seed (marked "*") and the method's (:data:`METHOD_KEYS`),
    sorted by key, and its runs' folders. Only finished out-of-domain runs are ranked;
    runs left out (``records.load_sweep``; ``strict``: an error) are counted and named.
    ``algorithm`` is a row label ("SAGM + CORAL", "SAGM + SWAD", "ERM (DomainBed)"), or
    a recorded algorithm (our ``config.algorithm`` "sagm", DomainBed's ``args.algorithm``
    "ERM"), which ranks each row of its runs."""
    loaded = load_sweep(input_dir, strict)
    rows = rows_of(loaded.groups, dataset, algorithm, test_env)
    names = env_labels(loaded.finished, input_dir).get(dataset)
    lines = [
        f"Total records: {sum(len(r.records) for r in loaded.runs)}",
        f"Runs: {len(loaded.finished)} finished, {len(loaded.incomplete)} incomplete (not "
        "ranked)" + (f"; {len(loaded.swad)} of them with a SWAD record" if loaded.swad else ""),
        f"Dataset {dataset}, test environment {env_label(dataset, test_env, names)}, "
        f"rows: {', '.join(rows)}",
        "hparams: those marked * differ between the settings of their trial seed (the "
        "others shown are the method's; the rest are the same in every setting).",
    ]
    if loaded.left_out:
        left_out = "; ".join(f"{path}: {why}" for path, why in loaded.left_out)
        lines.insert(2, f"Left out (not ranked; --strict refuses them): {left_out}")
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
            f"--dataset {dataset}: no finished out-of-domain runs; datasets: {', '.join(datasets)}."
        )
    labels = sorted({g[2] for g in ood}, key=method_order)
    recorded = collections.defaultdict(set)  # row -> its runs' recorded algorithms
    for (_, _, row, _, _), settings in ood.items():
        recorded[row] |= {recorded_algorithm(next(iter(r.values()))[0]) for r in settings.values()}
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
    """One ranked setting: its accuracies (and ``args.hparams_seed``), the
    hyperparameters that vary (marked ``*``) and the method's (:data:`METHOD_KEYS`), and
    the folders of its runs (``paths``: ``{test_envs: path}``), the single run first."""
    seed = next(iter(runs.values()))[0]["args"].get("hparams_seed")
    head = f"    {rank}. val_acc {choice['val_acc']:.4f}, test_acc {choice['test_acc']:.4f}"
    lines = [head + (f" (hparams_seed {seed})" if seed is not None else ""), "        hparams:"]
    lines += [
        f"        {'*' if k in varying else ' '} {k}: {v}"
        for k, v in sorted(hparams.items())
        if k in varying or k in METHOD_KEYS
    ]
    lines.append("        output_dirs:")
    lines += [
        f"          {path} (test envs {', '.join(map(str, envs))})"
        for envs, path in sorted(paths.items(), key=lambda item: (len(item[0]), item[0]))
    ]
    return lines
