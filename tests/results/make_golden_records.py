"""Writes ``golden_records.json``: a synthetic sweep for the collect_results golden test.

Run once (``python tests/results/make_golden_records.py``); the JSON is committed.
Accuracies are random (fixed seed) around a per-algorithm level. The sweep covers
PACS (with ``run_info.json`` env names) and VLCS (without), test environments 0 and 1
of 4, ERM / SAM / SAGM, trial seeds 0-2, two learning rates, three evaluations per run;
plus PACS SAGM + MixStyle over seeds 0-1 only, in-domain PACS runs, the leave-one-out
pair runs of PACS ERM and SAGM at lr 1e-5, one missing VLCS run, and one unfinished run.
"""

import json
import os

import numpy as np

LEVEL = {"erm": 0.80, "sam": 0.82, "sagm": 0.85}
rng = np.random.RandomState(0)
runs = []


def add(
    dataset,
    algorithm,
    test_envs,
    seed,
    lr,
    *,
    split="domainbed",
    mixstyle=False,
    done=True,
    run_info=True,
):
    config = {
        "dataset": dataset,
        "algorithm": algorithm,
        "test_envs": list(test_envs),
        "all_test_envs": False,
        "trial_seed": seed,
        "seed": seed,
        "lr": lr,
        "dropout": 0.5,
        "weight_decay": 1e-4,
        "alpha": 1e-3,
        "rho": 0.05,
        "mixstyle": mixstyle,
        "split": split,
    }
    records = []
    for step in (0, 100, 200):
        level = LEVEL[algorithm] + (0.02 if mixstyle else 0) + step / 2000 + (lr == 3e-5) * 0.01
        record = {"step": step}
        for env in range(4):
            for part in ("in", "out") + (("test",) if split == "in_domain" else ()):
                shift = -0.15 if env in test_envs else 0.0
                record[f"env{env}_{part}_acc"] = round(
                    float(np.clip(level + shift + rng.normal(0, 0.03), 0, 1)), 3
                )
        records.append(record)
    name = "_".join(
        [
            dataset,
            split,
            algorithm + ("_mixstyle" if mixstyle else ""),
            "t" + "".join(map(str, test_envs)),
            f"s{seed}",
            f"lr{lr:g}",
        ]
    )
    runs.append(
        {
            "path": os.path.join(dataset, name),
            "done": done,
            "env_names": (
                ["art_painting", "cartoon", "photo", "sketch"]
                if run_info and dataset == "PACS"
                else None
            ),
            "config": config,
            "records": records,
        }
    )


for dataset in ("PACS", "VLCS"):
    for algorithm in ("erm", "sam", "sagm"):
        for env in (0, 1):
            for seed in (0, 1, 2):
                for lr in (1e-5, 3e-5):
                    if (dataset, algorithm, env, seed) == ("VLCS", "sam", 1, 2):
                        continue  # a missing run: VLCS SAM has 2 of 3 seeds for env 1
                    add(dataset, algorithm, (env,), seed, lr)
for env in (0, 1):
    for seed in (0, 1):
        for lr in (1e-5, 3e-5):
            add("PACS", "sagm", (env,), seed, lr, mixstyle=True)
            add("PACS", "sagm", (env,), seed, lr, mixstyle=True, split="in_domain")
            add("PACS", "erm", (env,), seed, lr, split="in_domain")
for algorithm in ("erm", "sagm"):
    for seed in (0, 1, 2):
        for pair in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3)):
            add("PACS", algorithm, pair, seed, 1e-5)
add("VLCS", "sagm", (0,), 0, 5e-5, done=False)  # unfinished: listed, never selected

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_records.json")
with open(path, "w") as f:
    f.write("[\n" + ",\n".join(json.dumps(run, sort_keys=True) for run in runs) + "\n]\n")
print(f"{path}: {len(runs)} runs")
