"""sagm_jax.collect_results and the sweep-level selection functions.

Hand-computed cases check each selection rule; the golden files freeze the whole
report of a synthetic sweep (``golden_records.json``, see make_golden_records.py).
Regenerate the goldens after an intended change with
``UPDATE_GOLDEN=1 pytest tests/results/test_collect_results.py``.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from sagm_jax.results import collect as collect_results
from sagm_jax.results import selection

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = {  # (selection, latex) -> golden file
    ("training_domain", False): "golden_training_domain.md",
    ("training_domain", True): "golden_training_domain.tex",
    ("leave_one_out", False): "golden_leave_one_out.md",
    ("oracle_last", False): "golden_oracle_last.md",
    ("oracle_best", False): "golden_oracle_best.md",
}


def rec(step, **accs):
    return {"step": step, **accs}


# --- selection by hand -----------------------------------------------------------
# Three environments; test environment 0; accuracies chosen so that each rule picks
# a different checkpoint.
RUN = [
    rec(
        0,
        env0_in_acc=0.50,
        env0_out_acc=0.90,
        env1_out_acc=0.6,
        env2_out_acc=0.6,
        env1_in_acc=0.7,
        env2_in_acc=0.7,
    ),
    rec(
        1,
        env0_in_acc=0.60,
        env0_out_acc=0.70,
        env1_out_acc=0.8,
        env2_out_acc=0.9,
        env1_in_acc=0.7,
        env2_in_acc=0.7,
    ),
    rec(
        2,
        env0_in_acc=0.70,
        env0_out_acc=0.80,
        env1_out_acc=0.7,
        env2_out_acc=0.7,
        env1_in_acc=0.7,
        env2_in_acc=0.7,
    ),
]


def test_training_domain_run_picks_best_training_out_mean():
    # means of env1/env2 out: 0.6, 0.85, 0.7 -> step 1
    assert selection.training_domain_run({(0,): RUN}, 0) == {
        "step": 1,
        "val_acc": pytest.approx(0.85),
        "test_acc": 0.60,
    }


def test_oracle_last_takes_last_step_and_oracle_best_any_step():
    assert selection.oracle_last_run({(0,): RUN}, 0) == {
        "step": 2,
        "val_acc": 0.80,
        "test_acc": 0.70,
    }
    assert selection.oracle_best_run({(0,): RUN}, 0) == {
        "step": 0,
        "val_acc": 0.90,
        "test_acc": 0.50,
    }


def test_single_run_methods_ignore_pair_runs_and_need_the_single_run():
    for run_selection in (
        selection.training_domain_run,
        selection.oracle_last_run,
        selection.oracle_best_run,
    ):
        assert run_selection({(0, 1): RUN}, 0) is None


def test_leave_one_out_by_hand():
    # Pair run (0, 1) validates on env1's "in"; pair (0, 2) on env2's "in".
    pair01 = [
        rec(0, env0_out_acc=0, env1_in_acc=0.40, env2_out_acc=0, env1_out_acc=0),
        rec(1, env0_out_acc=0, env1_in_acc=0.60, env2_out_acc=0, env1_out_acc=0),
        rec(2, env0_out_acc=0, env1_in_acc=0.90, env2_out_acc=0, env1_out_acc=0),
    ]
    pair02 = [rec(0, env2_in_acc=0.40), rec(1, env2_in_acc=0.80)]  # no step 2
    runs = {(0,): RUN, (0, 1): pair01, (0, 2): pair02}
    # step 0: (.4 + .4) / 2 = .4; step 1: (.6 + .8) / 2 = .7; step 2 lacks pair (0, 2).
    assert selection.leave_one_out_run(runs, 0) == {
        "step": 1,
        "val_acc": pytest.approx(0.7),
        "test_acc": 0.60,
    }
    # Without every pair, no step qualifies.
    assert selection.leave_one_out_run({(0,): RUN, (0, 1): pair01}, 0) is None


def test_in_domain_run_scores_training_envs_test_part():
    run = [
        rec(
            0,
            env0_out_acc=0.9,
            env1_out_acc=0.5,
            env2_out_acc=0.5,
            env0_test_acc=0.1,
            env1_test_acc=0.2,
            env2_test_acc=0.4,
        ),
        rec(
            1,
            env0_out_acc=0.1,
            env1_out_acc=0.9,
            env2_out_acc=0.7,
            env0_test_acc=0.3,
            env1_test_acc=0.8,
            env2_test_acc=0.6,
        ),
    ]
    assert selection.in_domain_run({(0,): run}, 0) == {
        "step": 1,
        "val_acc": pytest.approx(0.8),
        "test_acc": pytest.approx(0.7),
    }


def test_sweep_selection_picks_setting_by_validation_not_test():
    good_val = [rec(0, env0_in_acc=0.5, env0_out_acc=0.6, env1_out_acc=0.9)]
    good_test = [rec(0, env0_in_acc=0.9, env0_out_acc=0.8, env1_out_acc=0.8)]
    settings = {"a": {(0,): good_test}, "b": {(0,): good_val}, "c": {(1,): good_val}}
    chosen = selection.sweep_selection(selection.training_domain_run, settings, 0)
    assert (chosen["setting"], chosen["test_acc"]) == ("b", 0.5)
    chosen = selection.sweep_selection(selection.oracle_last_run, settings, 0)
    assert (chosen["setting"], chosen["test_acc"]) == ("a", 0.9)
    assert (
        selection.sweep_selection(selection.training_domain_run, {"c": {(1,): good_val}}, 0) is None
    )


def test_standard_error_is_domainbeds_population_std_over_sqrt_n():
    cell = collect_results.mean_and_se([0.80, 0.84, 0.86], expected=3)
    assert cell.mean == pytest.approx(83.3333333)
    # deviations -3.333, 0.667, 2.667 -> var = (11.111 + 0.444 + 7.111) / 3 = 6.222
    assert cell.se == pytest.approx(np.sqrt(6.2222222) / np.sqrt(3))
    assert collect_results.format_cell(cell, latex=False) == "83.3 ± 1.4"
    assert collect_results.format_cell(cell._replace(n=2), latex=True) == "83.3 $\\pm$ 1.4 (2/3)"
    assert collect_results.format_cell(None, latex=False) == "-"


# --- the report of a synthetic sweep ---------------------------------------------


def fast_record(record: dict, test_envs) -> dict:
    """An all-split record as ``eval_splits="fast"`` writes it, by the rule written out
    here (SWAD's evaluator's): no 'in' accuracy or loss of a training environment."""
    dropped = {
        f"env{e}_in_{what}" for e in range(4) if e not in test_envs for what in ("acc", "loss")
    }
    return {k: v for k, v in record.items() if k not in dropped}


def write_sweep(root, eval_splits="all"):
    """The golden sweep's runs under ``root``; with ``eval_splits="fast"`` their records
    lack what fast mode does not evaluate (:func:`fast_record`)."""
    with open(os.path.join(HERE, "golden_records.json")) as f:
        runs = json.load(f)
    for run in runs:
        if eval_splits == "fast":
            run["config"] = {**run["config"], "eval_splits": "fast"}
            run["records"] = [fast_record(r, run["config"]["test_envs"]) for r in run["records"]]
        folder = os.path.join(root, run["path"])
        os.makedirs(folder)
        config = run["config"]
        args = {
            "dataset": config["dataset"],
            "algorithm": config["algorithm"],
            "test_envs": config["test_envs"],
            "trial_seed": config["trial_seed"],
            "seed": config["seed"],
            "output_dir": folder,
        }
        hparams = {
            k: config[k] for k in ("lr", "weight_decay", "dropout", "rho", "alpha", "mixstyle")
        }
        with open(os.path.join(folder, "results.jsonl"), "w") as f:
            for record in run["records"]:
                f.write(
                    json.dumps({**record, "args": args, "hparams": hparams, "config": config})
                    + "\n"
                )
        if run["done"]:
            open(os.path.join(folder, "done"), "w").close()
        if run["env_names"]:
            with open(os.path.join(folder, "run_info.json"), "w") as f:
                json.dump({"env_names": run["env_names"]}, f)
    os.makedirs(os.path.join(root, "VLCS", "not_started_job"))
    with open(os.path.join(root, "VLCS", "not_started_job", "args.json"), "w") as f:
        f.write("{}")


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sweep"))
    write_sweep(root)
    return root


@pytest.mark.parametrize("selection_name,latex", sorted(GOLDEN))
def test_report_matches_golden(sweep_dir, selection_name, latex):
    # The leave-one-out note's command names the sweep's folder: a temporary one here.
    report = collect_results.build_report(sweep_dir, selection_name, latex)
    report = report.replace(sweep_dir, "SWEEP_DIR")
    path = os.path.join(HERE, GOLDEN[selection_name, latex])
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(report)
    with open(path) as f:
        assert report == f.read()


@pytest.fixture(scope="module")
def fast_sweep_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fast_sweep"))
    write_sweep(root, eval_splits="fast")
    return root


@pytest.mark.parametrize("selection_name,latex", sorted(GOLDEN))
def test_fast_records_give_the_golden_report_of_the_all_split_records(
    fast_sweep_dir, selection_name, latex
):
    """The same sweep written as ``eval_splits="fast"`` records (the training
    environments' 'in' keys dropped): every selection chooses the same checkpoints and
    settings, so the report is the all-split records' golden file, to the character."""
    run = os.path.join(fast_sweep_dir, "PACS", "PACS_domainbed_erm_t0_s0_lr1e-05")
    with open(os.path.join(run, "results.jsonl")) as f:
        first = json.loads(f.readline())
    assert first["config"]["eval_splits"] == "fast"
    assert "env0_in_acc" in first and "env1_in_acc" not in first and "env1_out_acc" in first
    report = collect_results.build_report(fast_sweep_dir, selection_name, latex)
    report = report.replace(fast_sweep_dir, "SWEEP_DIR")
    with open(os.path.join(HERE, GOLDEN[selection_name, latex])) as f:
        assert report == f.read()


def test_report_cells_follow_from_the_records(sweep_dir):
    """One Table 1 cell recomputed here from the raw records, independently of the
    grouping code: PACS / ERM under training-domain validation."""
    with open(os.path.join(HERE, "golden_records.json")) as f:
        runs = [r for r in json.load(f) if r["done"]]
    per_seed = []
    for seed in (0, 1, 2):
        per_env = []
        for env in (0, 1):
            best = None  # (val, test) over both learning rates and all steps
            for run in runs:
                c = run["config"]
                if (
                    c["dataset"],
                    c["algorithm"],
                    c["test_envs"],
                    c["trial_seed"],
                    c["split"],
                    c["mixstyle"],
                ) != ("PACS", "erm", [env], seed, "domainbed", False):
                    continue
                for r in run["records"]:
                    val = np.mean([r[f"env{i}_out_acc"] for i in range(4) if i != env])
                    if best is None or val > best[0]:
                        best = (val, r[f"env{env}_in_acc"])
            per_env.append(best[1])
        per_seed.append(np.mean(per_env))
    x = 100 * np.array(per_seed)
    expected = f"| ERM | {x.mean():.1f} ± {x.std() / np.sqrt(3):.1f} |"
    report = collect_results.build_report(sweep_dir, "training_domain")
    assert expected in report


def test_report_marks_missing_seeds_and_lists_unfinished_runs(sweep_dir):
    report = collect_results.build_report(sweep_dir, "training_domain")
    table1 = report.split("### ")[1]
    sam_row = next(line for line in table1.splitlines() if line.startswith("| SAM |"))
    assert "(2/3)" in sam_row and "(partial)" in sam_row  # VLCS SAM lacks seed 2, env 1
    mixstyle_row = next(line for line in table1.splitlines() if "MixStyle" in line)
    assert mixstyle_row.endswith("| - | - |")  # no VLCS runs: no average
    assert "VLCS_domainbed_sagm_t0_s0_lr5e-05" in report and "not_started_job" in report
    assert "test environments 0, 1 only, of 4" in report


def test_leave_one_out_without_pairs_gives_no_entry(sweep_dir):
    report = collect_results.build_report(sweep_dir, "leave_one_out")
    table1 = report.split("### ")[1]
    assert "| SAM | - | - | - |" in table1  # SAM has no pair runs


def test_bad_input_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        collect_results.build_report(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no results.jsonl"):
        collect_results.build_report(str(tmp_path))
    write_sweep(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="'best'"):
        collect_results.build_report(str(tmp_path / "s"), "best")
    assert collect_results.main(["--input_dir", str(tmp_path / "nowhere")]) == 2
    bad = tmp_path / "bad" / "run"
    bad.mkdir(parents=True)
    (bad / "results.jsonl").write_text('{"step": 0}\n{not json\n{"step": 1}\n')
    with pytest.raises(ValueError, match="results.jsonl, line 2: not a JSON record"):
        collect_results.build_report(str(tmp_path / "bad"))


def test_the_tables_name_exactly_the_registered_methods_and_datasets():
    from sagm_jax import methods
    from sagm_jax.data import registry

    assert sorted(collect_results.HEAD_ORDER) == sorted(methods.rule_names("head"))
    assert set(collect_results.ABLATION_ALGORITHMS) <= set(methods.UPDATE_RULES)
    assert set(collect_results.TABLE_2_OBJECTIVES) <= set(methods.OBJECTIVES)
    assert collect_results.PAPER_DATASETS is registry.PAPER_DATASETS


def test_a_run_killed_mid_record_is_listed_incomplete_and_the_finished_runs_make_the_table(
    tmp_path,
):
    """A kill tore the last line of one unfinished run's results.jsonl: the shared reader
    drops that line with a warning, the run is listed as incomplete, and the finished
    runs make the same tables as without it."""
    root = tmp_path / "sweep"
    write_sweep(str(root))
    finished = root / "PACS" / "PACS_domainbed_erm_t0_s0_lr1e-05"
    first = (finished / "results.jsonl").read_text().splitlines(keepends=True)[0]
    torn = root / "PACS" / "killed_run"
    torn.mkdir()
    (torn / "results.jsonl").write_text(first + first[: len(first) // 2])  # cut short
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = collect_results.build_report(str(root), "training_domain")
    assert any("killed_run" in str(w.message) and "torn" in str(w.message) for w in caught)
    assert "killed_run" in report.split("Incomplete runs")[1]
    shutil.rmtree(torn)
    without = collect_results.build_report(str(root), "training_domain")
    assert report.split("Notes:")[0] == without.split("Notes:")[0]


def test_the_command_runs_from_anywhere_as_a_module(tmp_path):
    """``python -m sagm_jax.collect_results`` from another folder, without PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-m", "sagm_jax.collect_results"]
    out = subprocess.run([*command, "--help"], cwd=tmp_path, env=env, capture_output=True)
    assert out.returncode == 0 and b"--input_dir" in out.stdout, out.stderr
    write_sweep(str(tmp_path / "sweep"))
    out = subprocess.run(
        [*command, "--input_dir", "sweep", "--pm", "+/-"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == collect_results.build_report(str(tmp_path / "sweep"), pm="+/-")


def test_a_lost_or_repeated_record_is_named_not_tabled(tmp_path, capsys):
    """A finished run's records say which evaluations it made (its config's steps and
    eval_every: here 0, 100 and 200). A record deleted (`sed -i 2d`) would move oracle
    selection silently; the collector leaves the run out and names the file and the step
    (tests/results/test_records.py), or, with --strict, refuses the report."""
    root = tmp_path / "sweep"
    write_sweep(str(root))
    results = root / "PACS" / "PACS_domainbed_erm_t0_s0_lr1e-05" / "results.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    for record in records:
        record["config"].update(steps=201, eval_every=100)
    lines = [json.dumps(r) + "\n" for r in records]
    results.write_text("".join(lines))
    with open(os.path.join(HERE, GOLDEN["oracle_best", False])) as f:
        assert collect_results.build_report(str(root), "oracle_best") == f.read()
    results.write_text(lines[0] + lines[2])
    with pytest.raises(ValueError, match=rf"{results}: missing step\(s\) \[100\]"):
        collect_results.build_report(str(root), "oracle_best", strict=True)
    assert f"{results}: missing step(s) [100]" in collect_results.build_report(str(root))
    results.write_text(lines[0] + lines[1] + lines[1] + lines[2])
    assert collect_results.main(["--input_dir", str(root), "--strict"]) == 2
    assert f"{results}: repeated step(s) [100]" in capsys.readouterr().err
