"""DomainBed compatibility both ways: our collector reads records written by DomainBed's
``train.py``, and DomainBed's ``collect_results`` logic reads ours.

DomainBed cannot be installed here, so :func:`domainbed_tables` re-states the part of
its reader that touches a record, written for this test (not copied), keeping its key
accesses and arithmetic. It mirrors, in facebookresearch/DomainBed:

* ``domainbed/lib/reporting.py``: ``load_records`` (``<input_dir>/<subdir>/results.jsonl``,
  one level deep) and ``get_grouped_records`` (one group per ``args.trial_seed``,
  ``args.dataset``, ``args.algorithm`` and each entry of ``args.test_envs``);
* ``domainbed/model_selection.py``: ``SelectionMethod.hparams_accs`` / ``sweep_acc``
  (a group's records grouped by ``args.hparams_seed`` in sorted order (``Q.group``
  sorts its keys), stable-sorted by ``val_acc`` and reversed: the best ``val_acc`` wins,
  and of equal ones the LARGEST ``hparams_seed``, whatever order ``os.listdir`` gave),
  ``IIDAccuracySelectionMethod`` (records whose ``args.test_envs`` has one entry;
  ``val_acc`` = mean of ``env{i}_out_acc`` for ``i = 0, 1, ...`` while the key exists,
  ``i`` != the test env; ``test_acc`` = ``env{t}_in_acc``; ``Q.argmax`` = Python's
  ``max`` over the records: the first of equal steps) and
  ``OracleSelectionMethod`` (the record with the largest ``step``; ``env{t}_out_acc``
  ranks, ``env{t}_in_acc`` is reported) and ``LeaveOneOutSelectionMethod`` (a group's
  records by ``step``, in sorted order; at a step, exactly one record of a single-test-env
  run, and for each other environment ``v`` a pair run ``(t, v)`` whose ``env{v}_in_acc``
  fills ``val_accs[v]``; ``n_envs`` counts ``env{i}_out_acc`` of the step's first
  record; a missing ``v`` skips the step; ``val_acc = sum / (n_envs - 1)``);
* ``domainbed/scripts/collect_results.py``: ``format_mean`` (``100 * mean``,
  ``100 * std / sqrt(n)``, ``"{:.1f} +/- {:.1f}"``) and ``print_results_tables`` (the
  datasets DomainBed knows, one row per ``args.algorithm``, one column per test env).
"""

import collections
import itertools
import json
import os

import numpy as np
import pytest
from PIL import Image

from sagm_jax.results import collect as collect_results
from sagm_jax.training import rundir
from sagm_jax.sweep import jobs as sweep_jobs, launchers

HERE = os.path.dirname(os.path.abspath(__file__))
# DomainBed's datasets and their number of environments (datasets.num_environments).
DOMAINBED_DATASETS = {
    "RotatedMNIST": 6,
    "ColoredMNIST": 3,
    "VLCS": 4,
    "PACS": 4,
    "OfficeHome": 4,
    "TerraIncognita": 4,
    "DomainNet": 6,
}


# --- DomainBed's reader, re-stated ----------------------------------------------------


def load_records(path):
    records = []
    for subdir in os.listdir(path):
        try:
            with open(os.path.join(path, subdir, "results.jsonl")) as f:
                records += [json.loads(line[:-1]) for line in f]
        except OSError:
            pass
    return records


def iid_step_acc(record):
    test_env = record["args"]["test_envs"][0]
    keys = []
    for i in itertools.count():
        if f"env{i}_out_acc" not in record:
            break
        if i != test_env:
            keys.append(f"env{i}_out_acc")
    return {
        "val_acc": np.mean([record[k] for k in keys]),
        "test_acc": record[f"env{test_env}_in_acc"],
    }


def iid_run_acc(run_records):
    accs = [iid_step_acc(r) for r in run_records if len(r["args"]["test_envs"]) == 1]
    return max(accs, key=lambda a: a["val_acc"]) if accs else None


def oracle_run_acc(run_records):
    records = [r for r in run_records if len(r["args"]["test_envs"]) == 1]
    if not records:
        return None
    test_env = records[0]["args"]["test_envs"][0]
    last = sorted(records, key=lambda r: r["step"])[-1]
    return {"val_acc": last[f"env{test_env}_out_acc"], "test_acc": last[f"env{test_env}_in_acc"]}


def loo_step_acc(records):
    test_records = [r for r in records if len(r["args"]["test_envs"]) == 1]
    if len(test_records) != 1:
        return None
    test_env = test_records[0]["args"]["test_envs"][0]
    n_envs = 0
    for i in itertools.count():
        if f"env{i}_out_acc" not in records[0]:
            break
        n_envs += 1
    val_accs = np.zeros(n_envs) - 1
    for r in records:
        if len(r["args"]["test_envs"]) == 2:
            val_env = (set(r["args"]["test_envs"]) - {test_env}).pop()
            val_accs[val_env] = r[f"env{val_env}_in_acc"]
    val_accs = list(val_accs[:test_env]) + list(val_accs[test_env + 1 :])
    if any(v == -1 for v in val_accs):
        return None
    return {
        "val_acc": np.sum(val_accs) / (n_envs - 1),
        "test_acc": test_records[0][f"env{test_env}_in_acc"],
    }


def loo_run_acc(run_records):
    by_step = collections.defaultdict(list)
    for r in run_records:
        by_step[r["step"]].append(r)
    accs = [loo_step_acc(by_step[step]) for step in sorted(by_step)]  # Q.group: sorted keys
    accs = [a for a in accs if a is not None]
    return max(accs, key=lambda a: a["val_acc"]) if accs else None


def sweep_acc(records, run_acc):
    by_hparams = collections.defaultdict(list)
    for r in records:
        by_hparams[r["args"]["hparams_seed"]].append(r)
    accs = [run_acc(by_hparams[seed]) for seed in sorted(by_hparams)]  # Q.group: sorted keys
    accs = [a for a in accs if a is not None]

    def key(a):  # Q.sorted: NaN ranks lowest
        return float("-inf") if np.isnan(a["val_acc"]) else a["val_acc"]

    accs = sorted(accs, key=key)[::-1]  # stable sort, reversed: ties -> largest hparams_seed
    return accs[0]["test_acc"] if accs else None


def domainbed_accs(records, run_acc=iid_run_acc):
    """``{(trial_seed, dataset, algorithm, test_env): test accuracy}`` as DomainBed's
    ``sweep_acc`` selects it for each group of ``get_grouped_records``."""
    groups = collections.defaultdict(list)
    for r in records:
        for test_env in r["args"]["test_envs"]:
            key = (r["args"]["trial_seed"], r["args"]["dataset"], r["args"]["algorithm"], test_env)
            groups[key].append(r)
    accs = {k: sweep_acc(rs, run_acc) for k, rs in groups.items()}
    return {k: a for k, a in accs.items() if a is not None}


def domainbed_tables(input_dir, run_acc=iid_run_acc):
    """``{dataset: {algorithm: [cell per test env] + [avg]}}`` as DomainBed prints them."""
    records = load_records(input_dir)
    accs = domainbed_accs(records, run_acc)
    algorithms = sorted({r["args"]["algorithm"] for r in records})
    tables = {}
    for dataset in [d for d in DOMAINBED_DATASETS if d in {r["args"]["dataset"] for r in records}]:
        tables[dataset] = {}
        for algorithm in algorithms:
            cells, means = [], []
            for env in range(DOMAINBED_DATASETS[dataset]):
                trial_accs = [
                    a
                    for (t, d, al, e), a in accs.items()
                    if (d, al, e) == (dataset, algorithm, env)
                ]
                if trial_accs:
                    mean = 100 * np.mean(trial_accs)
                    err = 100 * np.std(np.array(trial_accs) / np.sqrt(len(trial_accs)))
                    cells.append(f"{mean:.1f} +/- {err:.1f}")
                    means.append(mean)
                else:
                    cells.append("X")
                    means.append(None)
            avg = "X" if None in means else f"{sum(means) / len(means):.1f}"
            tables[dataset][algorithm] = cells + [avg]
    return tables


# --- records written by DomainBed, read by our collector ------------------------------


def write_domainbed_run(
    root, name, *, test_env, trial_seed, hparams_seed, levels, done=True, steps=5001
):
    """One DomainBed job folder: results.jsonl as DomainBed's train.py writes it (VLCS,
    ERM, an evaluation per entry of ``levels`` at steps 0, 300, then ``steps - 1``), and
    ``done``."""
    folder = os.path.join(root, name)
    os.makedirs(folder)
    args = {
        "algorithm": "ERM",
        "checkpoint_freq": None,
        "data_dir": "/datasets",
        "dataset": "VLCS",
        "holdout_fraction": 0.2,
        "hparams": None,
        "hparams_seed": hparams_seed,
        "output_dir": folder,
        "save_model_every_checkpoint": False,
        "seed": 1234567 + trial_seed,
        "skip_model_save": False,
        "steps": steps,
        "task": "domain_generalization",
        "test_envs": [test_env],
        "trial_seed": trial_seed,
        "uda_holdout_fraction": 0,
    }
    hparams = {
        "batch_size": 32,
        "class_balanced": False,
        "data_augmentation": True,
        "lr": 5e-5 * (1 + hparams_seed),
        "nonlinear_classifier": False,
        "resnet18": False,
        "resnet_dropout": 0.0,
        "weight_decay": 0.0,
    }
    with open(os.path.join(folder, "results.jsonl"), "w") as f:
        for step, (val, test) in zip((0, 300, steps - 1)[: len(levels)], levels):
            record = {
                "args": args,
                "hparams": hparams,
                "step": step,
                "epoch": step / 30,
                "loss": 1.0,
                "mem_gb": 3.2,
                "step_time": 0.5,
            }
            for env in range(4):
                record[f"env{env}_in_acc"] = test if env == test_env else 0.9
                record[f"env{env}_out_acc"] = 0.5 if env == test_env else val
            f.write(json.dumps(record, sort_keys=True) + "\n")
    if done:
        with open(os.path.join(folder, "done"), "w") as f:
            f.write("done")


# (val, test) at the three steps, per (test env, trial seed, hparams seed).
LEVELS = {
    (0, 0, 0): [(0.6, 0.50), (0.8, 0.70), (0.7, 0.60)],  # best val 0.8 -> 0.70
    (0, 0, 1): [(0.6, 0.50), (0.9, 0.72), (0.7, 0.60)],  # best val 0.9 -> 0.72 (chosen)
    (0, 1, 0): [(0.95, 0.66), (0.8, 0.70), (0.7, 0.60)],  # 0.95 -> 0.66 (chosen)
    (0, 1, 1): [(0.6, 0.50), (0.9, 0.80), (0.7, 0.60)],
    (1, 0, 0): [(0.6, 0.40), (0.8, 0.60), (0.7, 0.50)],  # 0.8 -> 0.60 (chosen)
    (1, 0, 1): [(0.6, 0.40), (0.7, 0.90), (0.7, 0.50)],
    (1, 1, 0): [(0.6, 0.40), (0.8, 0.64), (0.9, 0.62)],  # 0.9 -> 0.62 (chosen)
    (1, 1, 1): [(0.6, 0.40), (0.8, 0.64), (0.7, 0.50)],
}


def write_domainbed_sweep(root, interrupted=True):
    for (env, trial, hp), levels in LEVELS.items():
        # One run without `done` whose last record is the last step: finished.
        write_domainbed_run(
            root,
            f"db_{env}_{trial}_{hp}",
            test_env=env,
            trial_seed=trial,
            hparams_seed=hp,
            levels=levels,
            done=(env, trial, hp) != (1, 1, 1),
        )
    if not interrupted:
        return
    # Interrupted (no `done`, last step short of steps - 1): listed, never selected.
    write_domainbed_run(
        root,
        "db_interrupted",
        test_env=0,
        trial_seed=0,
        hparams_seed=7,
        levels=[(1.0, 1.0), (1.0, 1.0)],
        done=False,
    )


def test_domainbed_records_are_read_and_grouped_by_hparams_seed(tmp_path):
    write_domainbed_sweep(str(tmp_path / "finished"), interrupted=False)
    # DomainBed's own reader on its records (it reads unfinished runs too: none here).
    tables = domainbed_tables(str(tmp_path / "finished"))
    assert tables["VLCS"]["ERM"][:2] == ["69.0 +/- 2.1", "61.0 +/- 0.7"]
    write_domainbed_sweep(str(tmp_path / "all"))
    report = collect_results.build_report(str(tmp_path / "all"), "training_domain")
    # Ours agrees, and leaves the interrupted run out. By hand: env 0: seeds 0.72, 0.66
    # -> 69.0 +- 3 / sqrt(2); env 1: 0.60, 0.62 -> 61.0 +- 1 / sqrt(2). Per seed:
    # (0.72 + 0.60) / 2 = 0.66, (0.66 + 0.62) / 2 = 0.64 -> 65.0 +- 1 / sqrt(2)
    # (DomainBed's s.e.: population std / sqrt(n)).
    assert "| ERM (DomainBed) | 65.0 ± 0.7 | 65.0 |" in report
    vlcs = report.split("### VLCS")[1]
    assert "| ERM (DomainBed) | 69.0 ± 2.1 | 61.0 ± 0.7 | 65.0 ± 0.7 |" in vlcs
    assert "db_interrupted" in report.split("Notes:")[1]  # incomplete: listed, not used


def test_our_and_domainbeds_records_in_one_table(tmp_path):
    from test_collect_results import write_sweep  # the golden sweep of our records

    write_sweep(str(tmp_path / "ours"))
    write_domainbed_sweep(str(tmp_path / "domainbed"))
    report = collect_results.build_report(str(tmp_path), "training_domain", pm="+/-")
    table1 = report.split("### ")[1]
    # PACS has no DomainBed runs; VLCS has 2 of the 3 trial seeds of the whole sweep.
    assert "| ERM (DomainBed) | - | 65.0 +/- 0.7 (2/3) | - |" in table1
    assert any(line.startswith("| SAGM | ") for line in table1.splitlines())
    assert "±" not in report  # --pm +/-: DomainBed's sign everywhere, notes included


def test_a_record_of_neither_kind_is_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.jsonl").write_text(json.dumps({"step": 0, "args": {}}) + "\n")
    with pytest.raises(ValueError, match="neither 'config'.*nor 'args.hparams_seed'"):
        collect_results.build_report(str(tmp_path))
    with pytest.raises(ValueError, match="--pm"):
        collect_results.build_report(str(tmp_path), pm="pm")


# --- settings whose validation accuracies tie ---------------------------------------


def write_our_run(root, name, *, lr, hparams_seed, levels):
    """One run folder as sagm_jax.training.train writes it (PACS, erm, test env 0; the fields the
    readers use), an evaluation per entry of ``levels`` = (val, test), and ``done``."""
    folder = os.path.join(root, name)
    os.makedirs(folder)
    config = {
        "algorithm": "erm",
        "dataset": "PACS",
        "lr": lr,
        "split": "domainbed",
        "test_envs": [0],
        "all_test_envs": False,
        "trial_seed": 0,
        "seed": 0,
    }
    args = {
        "algorithm": "erm",
        "dataset": "PACS",
        "test_envs": [0],
        "trial_seed": 0,
        "seed": 0,
        "hparams_seed": hparams_seed,
        "output_dir": folder,
    }
    with open(os.path.join(folder, "results.jsonl"), "w") as f:
        for step, (val, test) in enumerate(levels):
            record = {"step": step, "args": args, "config": config}
            for env in range(4):
                record[f"env{env}_in_acc"] = test if env == 0 else 0.9
                record[f"env{env}_out_acc"] = 0.5 if env == 0 else val
            f.write(json.dumps(record) + "\n")
    open(os.path.join(folder, "done"), "w").close()


REAL_LISTDIR = os.listdir


def listdir_in(order):
    """``os.listdir`` giving its names in ``order`` (DomainBed's load_records sees the
    job folders in whatever order the filesystem lists them)."""
    return lambda path=".": order(REAL_LISTDIR(path))


@pytest.mark.parametrize("kind", ["domainbed", "ours"])
@pytest.mark.parametrize("seeds", [(3, 5), (5, 3)])
def test_settings_that_tie_are_broken_as_domainbed_breaks_them(tmp_path, monkeypatch, kind, seeds):
    """Two settings with exactly equal validation accuracy (as 2-step runs on noise data
    give): DomainBed's reader takes the one with the larger ``args.hparams_seed``, in
    whichever order ``os.listdir`` lists the runs, and our collector takes the same one.
    The folder names, the learning rates and the setting keys order the settings
    against the seeds in one of the two cases, so no other rule passes both."""
    test_accs = (0.25, 0.75)
    expected = test_accs[seeds.index(max(seeds))]
    for name, seed, test, lr in zip(("b", "a"), seeds, test_accs, (1e-3, 1e-2)):
        levels = [(0.6, 0.1), (0.8, test)]  # the best step of each: 0.8, equal
        if kind == "domainbed":
            write_domainbed_run(
                str(tmp_path), name, test_env=0, trial_seed=0, hparams_seed=seed, levels=levels
            )
        else:
            write_our_run(str(tmp_path), name, lr=lr, hparams_seed=seed, levels=levels)
    dataset, algorithm = ("VLCS", "ERM") if kind == "domainbed" else ("PACS", "erm")
    for order in (sorted, lambda names: sorted(names, reverse=True)):
        monkeypatch.setattr(os, "listdir", listdir_in(order))
        cell = domainbed_tables(str(tmp_path))[dataset][algorithm][0]
        assert cell == f"{100 * expected:.1f} +/- 0.0"
    ours = collect_results.select(
        collect_results.group_runs(collect_results.load_runs(str(tmp_path))[0]), "training_domain"
    )
    assert list(ours.values()) == [expected]


# --- our records, read by DomainBed's reader ---------------------------------------


def test_hparams_seed_names_the_setting_not_the_test_env_or_seed():
    config = {"lr": 1e-5, "test_envs": [0], "all_test_envs": False, "trial_seed": 0, "seed": 0}
    same = {**config, "test_envs": [0, 1], "trial_seed": 2, "seed": 2}
    other = {**config, "lr": 3e-5}
    assert rundir.hparams_seed(config) == rundir.hparams_seed(same)
    assert rundir.hparams_seed(config) != rundir.hparams_seed(other)
    assert 0 <= rundir.hparams_seed(config) < 2**31


def write_golden_sweep_flat(root, eval_splits):
    """The finished out-of-domain runs of the golden sweep (golden_records.json), one
    level deep as DomainBed's ``load_records`` reads them, each record with ``args`` as
    sagm_jax.training.train writes them: ``hparams_seed``, and ``algorithm`` the method's
    label (``rundir.record_algorithm``; "SAGM + MixStyle" apart from "SAGM"). With
    ``eval_splits="fast"`` the records are what fast mode writes, by the rule written out
    here (SWAD's evaluator's): no 'in' accuracy of a training environment."""
    with open(os.path.join(HERE, "golden_records.json")) as f:
        runs = json.load(f)
    for run in runs:
        config = {**run["config"], "eval_splits": eval_splits}
        if not run["done"] or config["split"] != "domainbed":
            continue
        folder = os.path.join(root, os.path.basename(run["path"]))
        os.makedirs(folder)
        args = {k: config[k] for k in ("dataset", "test_envs", "trial_seed", "seed")}
        args.update(
            algorithm=rundir.record_algorithm(config),
            hparams_seed=rundir.hparams_seed(config),
            output_dir=folder,
        )
        train_envs = [e for e in range(4) if e not in args["test_envs"]]
        dropped = {f"env{e}_in_acc" for e in train_envs} if eval_splits == "fast" else set()
        with open(os.path.join(folder, "results.jsonl"), "w") as f:
            for record in run["records"]:
                record = {k: v for k, v in record.items() if k not in dropped}
                f.write(json.dumps({**record, "args": args, "config": config}) + "\n")
        open(os.path.join(folder, "done"), "w").close()


def ours_as_domainbeds(input_dir, selection_name):
    """Our collector's selected accuracies, keyed as :func:`domainbed_accs` keys them:
    ``(trial_seed, dataset, DomainBed's row, test env)``; our row is DomainBed's but for
    the names DomainBed spells otherwise (``rundir.DOMAINBED_ALGORITHMS``)."""
    groups = collect_results.group_runs(collect_results.load_runs(input_dir)[0])
    return {
        (seed, dataset, rundir.DOMAINBED_ALGORITHMS.get(row, row), t): acc
        for (_, dataset, row, seed, t), acc in collect_results.select(
            groups, selection_name
        ).items()
    }


@pytest.mark.parametrize(
    "run_acc,ours",
    [
        (iid_run_acc, "training_domain"),
        (oracle_run_acc, "oracle_last"),
        (loo_run_acc, "leave_one_out"),
    ],
)
def test_domainbeds_reader_selects_alike_from_fast_and_all_split_records(tmp_path, run_acc, ours):
    """DomainBed's own selection methods (training-domain validation, the oracle and
    leave-one-domain-out, re-stated above) read fast records: each group's accuracy is
    the one they select from the all-split records, and the one our collector selects."""
    write_golden_sweep_flat(str(tmp_path / "all"), "all")
    write_golden_sweep_flat(str(tmp_path / "fast"), "fast")
    fast_records = load_records(str(tmp_path / "fast"))
    single = next(r for r in fast_records if r["args"]["test_envs"] == [0])
    assert "env0_in_acc" in single and "env1_in_acc" not in single and "env1_out_acc" in single
    expected = domainbed_accs(load_records(str(tmp_path / "all")), run_acc)
    assert domainbed_accs(fast_records, run_acc) == expected
    # Every (dataset, method) has cells; leave-one-domain-out only where pairs exist.
    assert {(d, a) for _, d, a, _ in expected} == (
        {("PACS", "ERM"), ("PACS", "SAGM")}
        if ours == "leave_one_out"
        else {(d, a) for d in ("PACS", "VLCS") for a in ("ERM", "SAM", "SAGM")}
        | {("PACS", "SAGM + MixStyle")}
    )
    assert ours_as_domainbeds(str(tmp_path / "fast"), ours) == expected


def write_pacs_tree(root, n=2):
    """A stand-in PACS: its four domain folders, seven classes, tiny images."""
    rng = np.random.default_rng(0)
    for domain in ("art_painting", "cartoon", "photo", "sketch"):
        for c in range(7):
            os.makedirs(root / "PACS" / domain / f"class{c}")
            for k in range(n):
                pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / "PACS" / domain / f"class{c}" / f"{k}.png")


@pytest.mark.slow
def test_domainbeds_reader_prints_tables_from_our_sweep(tmp_path, monkeypatch):
    """Two real 2-step jobs (two learning rates) on a stand-in PACS, through the launcher's
    real command (a relaunch skips them, done); DomainBed's reader then selects between
    them by args.hparams_seed and prints PACS's table, with the accuracy our collector
    selects.

    On this noise data the two settings' validation accuracies usually tie exactly (2
    validation images per environment); then the larger ``args.hparams_seed`` wins in
    both readers. ``hparams_seed`` hashes the config, ``data_dir`` (a temporary folder)
    included, so which setting that is varies from run to run, and the job folders'
    listing order varies with the filesystem: the table must not depend on either."""
    monkeypatch.setenv("XLA_FLAGS", "")  # one CPU device for the jobs
    write_pacs_tree(tmp_path / "data")
    fixed = {
        "data_dir": str(tmp_path / "data"),
        "arch": "mnist_cnn",
        "pretrained_weights": "none",
        "dropout": 0.0,
        "image_size": 16,
        "batch_per_env": 4,
        "steps": 2,
        "eval_every": 1,
        "eval_batch_size": 8,
        "cache_dir": str(tmp_path / "cache"),
    }
    output = str(tmp_path / "sweep")
    jobs = sweep_jobs.make_jobs(["PACS"], ["erm"], ["0"], [0], {"lr": [1e-3, 1e-2]}, fixed, output)
    result = launchers.launch(jobs, log=lambda _: None)
    errors = [open(os.path.join(j.directory, "err.txt")).read()[-2000:] for j in jobs]
    assert len(result["finished"]) == 2, errors
    assert launchers.launch(jobs, log=lambda _: None)["skipped"] == jobs  # done: not run again
    records = load_records(output)
    assert sorted(r["step"] for r in records) == [0, 0, 1, 1]
    assert all(r["args"]["test_envs"] == [0] and r["hparams"]["batch_per_env"] == 4
               for r in records)
    # The default, eval_splits="fast": the training environments' 'in' parts are not
    # evaluated, and DomainBed's reader below reads such records all the same.
    for r in records:
        assert r["config"]["eval_splits"] == "fast"
        assert {k for k in r if k.endswith("_acc")} == {
            "env0_in_acc",
            *(f"env{e}_out_acc" for e in range(4)),
        }
    assert all("hparams_seed" in r["args"] for r in records), (
        "every record must hold args.hparams_seed = rundir.hparams_seed(config_dict)"
    )
    seeds = {r["args"]["hparams_seed"] for r in records}
    assert len(seeds) == 2  # one per setting
    for r in records:
        assert r["args"]["hparams_seed"] == rundir.hparams_seed(r["config"])
    ours = collect_results.select(
        collect_results.group_runs(collect_results.load_runs(output)[0]), "training_domain"
    )
    (accuracy,) = ours.values()
    for order in (sorted, lambda names: sorted(names, reverse=True)):
        monkeypatch.setattr(os, "listdir", listdir_in(order))
        tables = domainbed_tables(output)
        assert tables["PACS"]["ERM"][0] == f"{100 * accuracy:.1f} +/- 0.0"
        assert tables["PACS"]["ERM"][1:] == ["X", "X", "X", "X"]  # envs 1-3 not run
    # Without args.hparams_seed, DomainBed's reader fails as it did on our old records.
    for job in jobs:
        path = os.path.join(job.directory, "results.jsonl")
        lines = [json.loads(line) for line in open(path)]
        with open(path, "w") as f:
            for r in lines:
                del r["args"]["hparams_seed"]
                f.write(json.dumps(r) + "\n")
    with pytest.raises(KeyError, match="hparams_seed"):
        domainbed_tables(output)
