"""sagm_jax.results.records: which runs make the tables and which are left out, and
how a record's method is read (by us, and by DomainBed's collector, re-stated in
test_domainbed_records.py).

A damaged run (a lost, repeated or unreadable record; a second run of one setting and
test environments) is left out of the report and named with why in its notes; the
tables are those of the sweep without it. ``strict`` (``--strict``) refuses the report
instead. The sweep is the golden one of test_collect_results.py.
"""

import itertools
import json
import os
import shutil

import numpy as np
import pytest

from sagm_jax.results import collect as collect_results
from sagm_jax.results import records as records_lib
from sagm_jax.training import rundir
from test_collect_results import GOLDEN, HERE, write_sweep
from test_domainbed_records import (
    domainbed_accs,
    domainbed_tables,
    iid_run_acc,
    load_records,
    oracle_run_acc,
    ours_as_domainbeds,
)

RUN = os.path.join("PACS", "PACS_domainbed_erm_t0_s0_lr1e-05")


def tables(report: str) -> str:
    return report.split("Notes:")[0]


def golden_tables() -> str:
    with open(os.path.join(HERE, GOLDEN["training_domain", False])) as f:
        return tables(f.read())


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    write_sweep(str(root))
    return root


def damage(results, how: str) -> None:
    """A finished run's records with a record lost, repeated or replaced by a non-record
    (its config says it evaluates after steps 0, 100 and 200)."""
    records = [json.loads(line) for line in results.read_text().splitlines()]
    for record in records:
        record["config"].update(steps=201, eval_every=100)
    lines = [json.dumps(r) + "\n" for r in records]
    lines = {
        "lost": [lines[0], lines[2]],
        "repeated": [lines[0], lines[1], lines[1], lines[2]],
        "unreadable": [lines[0], "{not json\n", lines[2]],
    }[how]
    results.write_text("".join(lines))


@pytest.mark.parametrize(
    "how,why",
    [
        ("lost", ": missing step(s) [100]"),
        ("repeated", ": repeated step(s) [100]"),
        ("unreadable", ", line 2: not a JSON record"),
    ],
)
def test_a_damaged_run_is_left_out_and_named(sweep, tmp_path, capsys, how, why):
    results = sweep / RUN / "results.jsonl"
    damage(results, how)
    report = collect_results.build_report(str(sweep))
    assert f"- Left out {RUN} (--strict refuses the report instead): {results}{why}" in report
    # The tables are those of the sweep without the run.
    without = tmp_path / "without"
    shutil.copytree(sweep, without)
    shutil.rmtree(without / RUN)
    assert tables(report) == tables(collect_results.build_report(str(without)))
    with pytest.raises(ValueError, match=f"{results}"):
        collect_results.build_report(str(sweep), strict=True)
    assert collect_results.main(["--input_dir", str(sweep), "--strict"]) == 2
    assert why in capsys.readouterr().err
    assert collect_results.main(["--input_dir", str(sweep)]) == 0
    ranked = collect_results.top_hparams(str(sweep), "PACS", "ERM", 0)
    assert f"Left out (not ranked; --strict refuses them): {RUN}: {results}{why}" in ranked
    with pytest.raises(ValueError, match=f"{results}"):
        collect_results.top_hparams(str(sweep), "PACS", "ERM", 0, strict=True)


def test_a_second_run_of_one_setting_is_left_out_and_named(sweep):
    """A run copied to another folder: the first in path order is kept, so the tables
    are the golden ones; the copy is named. Strict: refused, naming both."""
    copy = os.path.join("PACS", "zz_copy")
    shutil.copytree(sweep / RUN, sweep / copy)
    report = collect_results.build_report(str(sweep))
    assert tables(report) == golden_tables()
    assert (
        f"- Left out {copy} (--strict refuses the report instead): have the same config, "
        f"test environments and data; remove one. (kept: {RUN})"
    ) in report
    with pytest.raises(ValueError, match=f"runs {RUN} and {copy} have the same config, test"):
        collect_results.build_report(str(sweep), strict=True)


def write_split(folder, total: int) -> None:
    """A split record whose fingerprint counts ``total`` images of one class in one
    environment."""
    fingerprint = {
        "counts": {"art_painting": {"dog": total}},
        "domain_totals": {"art_painting": total},
        "total": total,
    }
    (folder / rundir.SPLIT).write_text(json.dumps({"fingerprint": fingerprint}))


def test_the_same_config_on_other_data_is_named_as_such(sweep):
    """Two runs of one config whose split records fingerprint other data are not called
    duplicates: the report says they were trained on different data and what differs.
    With the same fingerprint (the same data under another data_dir, which is no
    hyperparameter), they are the same run twice."""
    other = os.path.join("PACS", "zz_other_data")
    shutil.copytree(sweep / RUN, sweep / other)
    write_split(sweep / RUN, 10)
    write_split(sweep / other, 12)
    results = sweep / other / "results.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    lines = [
        json.dumps({**r, "config": {**r["config"], "data_dir": "/elsewhere"}}) for r in records
    ]
    results.write_text("\n".join(lines) + "\n")
    report = collect_results.build_report(str(sweep))
    assert tables(report) == golden_tables()
    assert (
        f"- Left out {other} (--strict refuses the report instead): have the same config and "
        "test environments but were trained on different data (environment `art_painting`: "
        "10 -> 12 images (class `dog`: 10 -> 12)); a table compares runs on one dataset: "
        f"move one out of the input folder. (kept: {RUN})"
    ) in report
    with pytest.raises(ValueError, match="but were trained on different data"):
        collect_results.build_report(str(sweep), strict=True)
    write_split(sweep / other, 10)
    report = collect_results.build_report(str(sweep))
    assert "have the same config, test environments and data; remove one." in report


def test_a_finished_run_without_records_lost_them(sweep):
    """A run with ``done`` and an empty results.jsonl finished and lost its records: the
    notes say so, not that it never started (a job folder without records)."""
    lost = sweep / "PACS" / "lost_run"
    lost.mkdir()
    (lost / rundir.CONFIG).write_text("{}")
    (lost / rundir.RESULTS).write_text("")
    (lost / rundir.DONE).write_text("done\n")
    report = collect_results.build_report(str(sweep))
    assert "- Jobs without records (not started): VLCS/not_started_job." in report
    assert (
        "- Finished runs without records ('done', but results.jsonl is empty or missing: "
        "they finished and lost their records; left out): PACS/lost_run."
    ) in report
    assert tables(report) == golden_tables()


# --- the method of a record ----------------------------------------------------------


def our_record(config: dict, folder="/runs/x", step=0, accuracies=None) -> dict:
    """The record that a run of ``config`` writes (``rundir.make_record``)."""
    return rundir.make_record(
        config,
        folder,
        step=step,
        loss=1.0,
        accuracies=accuracies or {},
        test_envs=config.get("test_envs", [0]),
        smallest_env=100,
    )


METHODS = [  # (objective, algorithm, mixstyle) -> the tables' row
    (("erm", "erm", False), "ERM"),
    (("coral", "erm", False), "CORAL"),
    (("mixup", "erm", False), "ERM + Mixup"),
    (("coral", "sagm", False), "SAGM + CORAL"),
    (("erm", "and_mask", False), "AND-mask"),
    (("erm", "sagm", True), "SAGM + MixStyle"),
]


@pytest.mark.parametrize("method,row", METHODS)
def test_the_row_comes_from_the_config_whatever_args_algorithm_holds(method, row):
    """New records hold the method's label in ``args.algorithm`` (DomainBed's name where
    it has one): the row is still the config's method. Records written before held the
    update rule there, and a config without ``algorithm`` reads it from there; such a
    config with a label there reads the label back."""
    objective, algorithm, mixstyle = method
    config = {
        "dataset": "PACS",
        "objective": objective,
        "algorithm": algorithm,
        "disam_lambda": 0.0,
        "mixstyle": mixstyle,
        "trial_seed": 0,
        "seed": 0,
        "batch_per_env": 32,
    }
    record = our_record(config)
    assert record["args"]["algorithm"] == rundir.record_algorithm(config)
    assert records_lib.method_name(record) == row
    assert records_lib.method_of(record) == (objective, algorithm, 0.0)
    assert records_lib.recorded_algorithm(record) == algorithm
    without = {k: v for k, v in config.items() if k != "algorithm"}
    old = {**record, "args": {**record["args"], "algorithm": algorithm}, "config": without}
    assert records_lib.method_name(old) == row
    labelled = {**record, "config": without}
    assert records_lib.method_of(labelled) == (objective, algorithm, 0.0)


# (objective, algorithm, disam_lambda, mixstyle) -> the row of DomainBed's collector
SEVERAL_METHODS = {
    ("erm", "erm", 0.0, False): "ERM",
    ("coral", "erm", 0.0, False): "CORAL",
    ("mixup", "erm", 0.0, False): "Mixup",
    ("mmd", "erm", 0.0, False): "MMD",
    ("groupdro", "erm", 0.0, False): "GroupDRO",
    ("irm", "erm", 0.0, False): "IRM",
    ("vrex", "erm", 0.0, False): "VREx",
    ("erm", "fish", 0.0, False): "Fish",
    ("erm", "and_mask", 0.0, False): "ANDMask",
    ("erm", "mldg", 0.0, False): "MLDG",
    ("erm", "sagm", 0.0, False): "SAGM",
    ("coral", "sagm", 0.0, False): "SAGM + CORAL",
    ("erm", "sagm", 0.1, False): "DISAM on SAGM",
    ("erm", "sagm", 0.0, True): "SAGM + MixStyle",
}


def write_methods_sweep(root):
    """Every method of :data:`SEVERAL_METHODS` on PACS, test environments 0 and 1, trial
    seeds 0 and 1, two learning rates, records made by ``rundir.make_record`` (what a run
    writes), random accuracies; one level deep, as DomainBed's ``load_records`` reads."""
    rng = np.random.RandomState(28)
    for (objective, algorithm, disam, mixstyle), t, seed, lr in itertools.product(
        SEVERAL_METHODS, (0, 1), (0, 1), (1e-5, 3e-5)
    ):
        config = {
            "dataset": "PACS",
            "objective": objective,
            "algorithm": algorithm,
            "disam_lambda": disam,
            "mixstyle": mixstyle,
            "split": "domainbed",
            "test_envs": [t],
            "all_test_envs": False,
            "trial_seed": seed,
            "seed": seed,
            "batch_per_env": 32,
            "lr": lr,
        }
        folder = os.path.join(root, f"{objective}_{algorithm}_{disam}_{mixstyle}_{t}_{seed}_{lr}")
        os.makedirs(folder)
        with open(os.path.join(folder, "results.jsonl"), "w") as f:
            for step in (0, 100, 200):
                accuracies = {
                    f"env{e}_{part}_acc": round(float(rng.uniform(0.4, 0.9)), 3)
                    for e in range(4)
                    for part in ("in", "out")
                }
                f.write(json.dumps(our_record(config, folder, step, accuracies)) + "\n")
        open(os.path.join(folder, "done"), "w").close()


@pytest.mark.parametrize(
    "run_acc,ours", [(iid_run_acc, "training_domain"), (oracle_run_acc, "oracle_last")]
)
def test_domainbeds_reader_tells_our_objectives_and_procedures_apart(tmp_path, run_acc, ours):
    """A folder of many objectives and procedures: DomainBed's reader gives each method
    its own row, named as DomainBed names it (CORAL, Mixup, ANDMask) or by our label
    (SAGM + CORAL), not one row per update rule choosing between methods as if they
    were settings; each cell is the one our collector selects for that method."""
    write_methods_sweep(str(tmp_path))
    records = load_records(str(tmp_path))
    expected = domainbed_accs(records, run_acc)
    assert {a for _, _, a, _ in expected} == set(SEVERAL_METHODS.values())
    assert len(expected) == len(SEVERAL_METHODS) * 2 * 2  # test envs x trial seeds
    assert ours_as_domainbeds(str(tmp_path), ours) == expected
    tables = domainbed_tables(str(tmp_path), run_acc)
    assert sorted(tables["PACS"]) == sorted(SEVERAL_METHODS.values())
