"""What a run prints when it ends: the run summary (``print_summary``: the step
training-domain validation selects and its accuracy per environment and split part,
SWAD's beside it) and, for ``config.all_test_envs``, the markdown table of one test
accuracy per environment (``markdown_test_accuracies``)."""

from __future__ import annotations

import numpy as np

from sagm_jax.data import registry
from sagm_jax.results.selection import training_domain_validation

__all__ = ["markdown_test_accuracies", "print_summary"]


def print_summary(records: list[dict], test_envs, env_names=None, swad_record=None) -> None:
    """The step chosen by training-domain validation and its accuracy (%) per environment
    and split part, as the result tables show accuracies; with ``swad_record``, the SWAD
    model's beside them. A part the records do not hold (the training environments' 'in'
    parts with ``config.eval_splits="fast"``, which evaluates only what model selection
    reads) shows "-", and a line below the table says why."""
    if not records:
        print("No evaluation records.")
        return
    chosen = training_domain_validation(records, test_envs)
    envs = sorted({int(k[3:].split("_")[0]) for k in chosen if k.startswith("env")})
    parts = [p for p in ("in", "out", "test") if any(f"env{e}_{p}_acc" in chosen for e in envs)]
    # The index (what config.test_envs takes), then the name as the result tables show it.
    dataset = records[-1].get("args", {}).get("dataset")
    labels = {e: registry.env_label(dataset, e, env_names) for e in envs}
    names = {e: f"env{e}" + (f" {labels[e]}" if env_names else "") for e in envs}
    width = max(len(n) for n in names.values()) + 8
    print(
        f"Selected step {chosen['step']} by training-domain validation (mean 'out' accuracy "
        f"of the training environments {100 * chosen['validation_acc']:.1f}%):"
    )
    columns = [(chosen, p, f"{p} %") for p in parts]
    if swad_record is not None:
        columns += [(swad_record, p, f"SWAD {p} %") for p in parts]
    print("  " + "environment".ljust(width) + "".join(f"{c[2]:>11}" for c in columns))
    missing = set()
    for e in envs:
        label = f"{names[e]} ({'test' if e in test_envs else 'train'})"
        cells = []
        for r, p, _ in columns:
            if f"env{e}_{p}_acc" in r:
                cells.append(f"{100 * r[f'env{e}_{p}_acc']:>11.1f}")
            else:
                cells.append(f"{'-':>11}")
                missing.add((e, p))
        print("  " + label.ljust(width) + "".join(cells))
    if missing:
        print(_missing_parts_note(missing, envs, test_envs, records[-1]))
    tests = ", ".join(f"{names[e]} {100 * chosen[f'env{e}_in_acc']:.1f}%" for e in test_envs)
    print(f"Test accuracy ('in' split of the test environment): {tests}")
    if swad_record is not None:
        swad = ", ".join(f"{names[e]} {100 * swad_record[f'env{e}_in_acc']:.1f}%" for e in test_envs)
        info = swad_record["swad"]
        print(
            f"SWAD test accuracy: {swad} (the mean of {info['segments']} segments, steps "
            f"{info['first_step']}-{info['last_step']})"
        )


def _missing_parts_note(missing: set, envs, test_envs, record: dict) -> str:
    """Why the summary shows "-": with ``eval_splits="fast"`` the training environments'
    'in' parts are not evaluated; anything else (records without a config among them) is
    named as not in the records."""
    train_in = {(e, "in") for e in envs if e not in test_envs}
    eval_splits = record.get("config", {}).get("eval_splits")
    if missing <= train_in and eval_splits == "fast":
        return (
            "  - : training environments' 'in' parts are not evaluated (config.eval_splits="
            "fast; --config.eval_splits=all evaluates every part)"
        )
    parts = ", ".join(f"env{e} '{p}'" for e, p in sorted(missing))
    return f"  - : not in the records: {parts}"


def markdown_test_accuracies(config, env_names, accuracies: dict) -> str:
    """The markdown table of one test accuracy per environment and their average."""
    average = 100 * np.mean(list(accuracies.values()))
    return "\n".join(
        [
            f"{config.dataset} / {config.algorithm}, test accuracy (training-domain "
            f"validation), % (the 'in' split of each test environment):",
            "",
            "| " + " | ".join(["test environment", *env_names, "Avg"]) + " |",
            "|---|" + ":-:|" * (len(env_names) + 1),
            "| accuracy | "
            + " | ".join(f"{100 * a:.1f}" for a in accuracies.values())
            + f" | {average:.1f} |",
        ]
    )
