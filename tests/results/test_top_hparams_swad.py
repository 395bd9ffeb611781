"""``--top_hparams``, ``--winners`` and the "+ SWAD" rows of sagm_jax.collect_results.

The sweep is made here: ColoredMNIST (3 environments), test environments 0 and 1, trial
seeds 0 and 1, rows SAGM (every run with a SWAD record, ``swad.jsonl``) and SAGM + CORAL
(none), three settings each (lr and dropout vary; ``args.hparams_seed`` 0, 1, 2), each
setting with its single runs (0,), (1,) and the pair runs (0, 1), (0, 2), (1, 2) that
leave-one-domain-out needs; three evaluations per run, random accuracies; the SWAD
records' steps differ between the runs of a setting (valleys end apart). In one cell two
settings have the same records (a tie: DomainBed ranks the larger hparams_seed first).
An unfinished run with far better accuracies and a SWAD record must change nothing.
Every test runs on the sweep written twice: with every split part, and as
``eval_splits="fast"`` records (no training environment's 'in' accuracy).

Every expected value is restated in this file from the records it wrote, with NumPy:
training-domain validation (mean training-environment ``out`` accuracy, earliest best
step), leave-one-domain-out (mean over v of the pair run (t, v)'s ``env{v}_in`` at a step),
the oracle (last step, test environment's ``out``), the ranking (by validation accuracy,
ties by hparams_seed descending), and the cells (mean +- std/sqrt(n) in % over seeds of
the per-seed mean over test environments).
"""

import collections
import json

import numpy as np
import pytest

from sagm_jax.results import collect as collect_results

DATASET, ENVS, TEST_ENVS, SEEDS = "ColoredMNIST", 3, (0, 1), (0, 1)
RUN_ENVS = [(0,), (1,), (0, 1), (0, 2), (1, 2)]
SETTINGS = [  # hparams_seed -> the hyperparameters that vary
    {"lr": 1e-5, "dropout": 0.0},
    {"lr": 3e-5, "dropout": 0.0},
    {"lr": 3e-5, "dropout": 0.1},
]
ROWS = {
    "SAGM": {"algorithm": "sagm", "swad": True},
    "SAGM + CORAL": {"algorithm": "sagm", "objective": "coral"},
}
TIE = ("SAGM", 1)  # in this (row, trial seed), settings 1 and 2 have the same records
STEPS = (0, 100, 200)
UNFINISHED = "SAGM_s0_unfinished_t0"

Spec = collections.namedtuple("Spec", "config records swad done hparams_seed")


def accuracies(rng, test_envs, parts=("in", "out")):
    return {
        f"env{e}_{part}_acc": round(float(rng.uniform(0.5, 0.9) - 0.2 * (e in test_envs)), 3)
        for e in range(ENVS)
        for part in parts
    }


def path_of(row, seed, h, envs):
    return f"{row.replace(' + ', '_')}_s{seed}_h{h}_t{''.join(map(str, envs))}"


def make_runs():
    """``{path: Spec}``: every run of the sweep."""
    rng = np.random.RandomState(19)
    runs, tied = {}, {}
    for row, method in ROWS.items():
        for seed in SEEDS:
            for h, varying in enumerate(SETTINGS):
                for envs in RUN_ENVS:
                    config = {
                        "dataset": DATASET,
                        "test_envs": list(envs),
                        "all_test_envs": False,
                        "trial_seed": seed,
                        "seed": seed,
                        "weight_decay": 0.0,
                        "rho": 0.05,
                        "mixstyle": False,
                        "split": "domainbed",
                        "data_dir": "/data",  # not a hyperparameter (rundir.RESULT_FREE)
                        **varying,
                        **method,
                    }
                    records = [{"step": s, **accuracies(rng, envs)} for s in STEPS]
                    swad = {"step": 150 + 10 * RUN_ENVS.index(envs), **accuracies(rng, envs)}
                    if (row, seed) == TIE and h == 2:  # the same numbers as setting 1
                        records, swad = tied[envs]
                    tied[envs] = (records, swad)
                    swad = swad if method.get("swad") else None
                    runs[path_of(row, seed, h, envs)] = Spec(config, records, swad, True, h)
    # Unfinished: better than everything, with a SWAD record; it must be left out.
    config = {**runs[path_of("SAGM", 0, 0, (0,))].config, "lr": 9e-5}
    best = [{"step": s, **{k: 1.0 for k in accuracies(rng, (0,))}} for s in STEPS]
    runs[UNFINISHED] = Spec(config, best, dict(best[-1], step=200), False, 9)
    return runs


RUNS = make_runs()


def write_record(record, config, folder, h):
    """A record as sagm_jax.training.train writes it: accuracies, ``args``, ``hparams``, ``config``."""
    args = {k: config[k] for k in ("dataset", "algorithm", "test_envs", "trial_seed", "seed")}
    args.update(hparams_seed=h, output_dir=str(folder))
    return {**record, "args": args, "hparams": {"lr": config.get("lr")}, "config": config}


def fast(record, test_envs):
    """The record as ``eval_splits="fast"`` writes it (the rule written out here, SWAD's
    evaluator's): without the 'in' accuracy of the training environments."""
    dropped = {f"env{e}_in_acc" for e in range(ENVS) if e not in test_envs}
    return {k: v for k, v in record.items() if k not in dropped}


def write_run(folder, spec, eval_splits="all"):
    """The run's files; with ``eval_splits="fast"`` its records (and SWAD record) lack the
    training environments' 'in' accuracies, as a fast-mode run writes them."""
    if eval_splits == "fast":
        envs = spec.config["test_envs"]
        records = [fast(r, envs) for r in spec.records]
        swad = None if spec.swad is None else fast(spec.swad, envs)
        assert len(records[0]) == 1 + ENVS + len(envs)  # step, every 'out', the tests' 'in'
        spec = spec._replace(records=records, swad=swad)
    folder.mkdir()
    records = [write_record(r, spec.config, folder, spec.hparams_seed) for r in spec.records]
    lines = [json.dumps(r) for r in records]
    (folder / "results.jsonl").write_text("\n".join(lines) + "\n")
    if spec.swad is not None:
        step = spec.swad["step"]
        mark = {"first_step": step - 50, "last_step": step, "segments": 5, "dead_at_step": None}
        record = write_record(spec.swad, spec.config, folder, spec.hparams_seed)
        (folder / "swad.jsonl").write_text(json.dumps({**record, "swad": mark}) + "\n")
    if spec.done:
        (folder / "done").write_text("")


@pytest.fixture(scope="module", params=["all", "fast"])
def sweep_dir(tmp_path_factory, request):
    """The sweep, its records written with every split part, then as fast records: every
    test below (each expected value restated from the full records) holds for both."""
    root = tmp_path_factory.mktemp(f"swad_sweep_{request.param}")
    for path, spec in RUNS.items():
        write_run(root / path, spec, request.param)
    return str(root)


# --- The selections, restated --------------------------------------------------


def runs_of(row, seed, h, use_swad):
    """``{test_envs: records}`` of one finished setting (the SWAD record as a one-record run)."""
    runs = {envs: RUNS[path_of(row, seed, h, envs)] for envs in RUN_ENVS}
    return {envs: [spec.swad] if use_swad else spec.records for envs, spec in runs.items()}


def restated(rule, runs, t):
    """``(val_acc, test_acc)`` of one setting under ``rule``."""
    single = runs[(t,)]
    train = [e for e in range(ENVS) if e != t]
    if rule == "oracle_last":
        return single[-1][f"env{t}_out_acc"], single[-1][f"env{t}_in_acc"]
    if rule == "training_domain":
        vals = [np.mean([r[f"env{e}_out_acc"] for e in train]) for r in single]
    else:  # leave_one_out: the i-th record of every run (SWAD's: the one, whatever its step)
        pairs = [runs[tuple(sorted((t, v)))] for v in train]
        vals = [
            np.mean([p[i][f"env{v}_in_acc"] for p, v in zip(pairs, train)])
            for i in range(len(single))
        ]
    vals = np.array(vals)
    i = int(np.flatnonzero(vals == vals.max())[0])
    return vals[i], single[i][f"env{t}_in_acc"]


def ranking(rule, row, seed, t, use_swad):
    """``[(hparams_seed, val_acc, test_acc)]`` best first; equal validation: larger seed first."""
    runs = [runs_of(row, seed, h, use_swad) for h in range(len(SETTINGS))]
    scored = [(h, *restated(rule, r, t)) for h, r in enumerate(runs)]
    return sorted(scored, key=lambda x: (-x[1], -x[0]))


def mean_se(values):
    x = 100 * np.array(values)
    return f"{x.mean():.1f} ± {x.std() / np.sqrt(len(x)):.1f}"


def cell_text(row, rule, use_swad):
    """The dataset entry of a row over seeds: the per-seed mean over test environments of
    the winners' test accuracy."""
    return mean_se(
        [np.mean([ranking(rule, row, s, t, use_swad)[0][2] for t in TEST_ENVS]) for s in SEEDS]
    )


def env_text(row, rule, use_swad, t):
    return mean_se([ranking(rule, row, s, t, use_swad)[0][2] for s in SEEDS])


def table(report, title):
    block = next(b for b in report.split("### ") if b.startswith(title))
    return [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]


def test_the_sweep_exercises_ties_and_winners_that_differ():
    """The data make the other tests able to fail: the tie is a tie between the two best
    settings, and the winner depends on the rule and on SWAD."""
    tied = ranking("training_domain", *TIE, 0, use_swad=False)
    assert tied[0][1] == tied[1][1] and {tied[0][0], tied[1][0]} == {1, 2}

    def winners(rule, use_swad):
        return [ranking(rule, "SAGM", s, t, use_swad)[0][0] for s in SEEDS for t in TEST_ENVS]

    assert winners("training_domain", True) != winners("training_domain", False)
    assert winners("leave_one_out", True) != winners("training_domain", True)
    assert winners("oracle_last", True) != winners("training_domain", True)


# --- +SWAD rows ----------------------------------------------------------------


RULES = ["training_domain", "leave_one_out", "oracle_last", "oracle_best"]


@pytest.mark.parametrize("rule", RULES)
def test_swad_rows_follow_their_method_with_the_swad_records_cells(sweep_dir, rule):
    report = collect_results.build_report(sweep_dir, rule)
    expected_rows = {"SAGM": False, "SAGM + SWAD": True, "SAGM + CORAL": False}
    rows = [r for r in table(report, "Table 1")[1:] if " | - | - |" not in r]  # swept rows
    assert [r.split(" | ")[0][2:] for r in rows] == list(expected_rows)
    base_rule = "oracle_last" if rule == "oracle_best" else rule
    for line, (row, use_swad) in zip(rows, expected_rows.items()):
        base = row.removesuffix(" + SWAD")
        if rule == "oracle_best" and not use_swad:
            continue  # any checkpoint: not restated here (test_collect_results does)
        cell = cell_text(base, base_rule, use_swad)
        published = "66.1 (SAGM paper)" if row == "SAGM" else "-"
        assert line == f"| {row} | {cell} | {cell.split(' ±')[0]} | {published} |"
    per_env = table(report, DATASET)
    swad_line = next(r for r in per_env if r.startswith("| SAGM + SWAD |"))
    envs = [env_text("SAGM", base_rule, True, t) for t in TEST_ENVS]
    entry = cell_text("SAGM", base_rule, True)
    assert swad_line == f"| SAGM + SWAD | {' | '.join(envs)} | {entry} |"
    assert "SAGM + CORAL + SWAD" not in report
    assert "+ SWAD" not in report.split("### Table 3")[1].split("Notes:")[0]


def test_swad_rows_in_table_2(tmp_path):
    """In-domain runs with SWAD records: the in-domain cell is the SWAD record's mean
    training-environment test accuracy (one setting, so no choice)."""
    rng = np.random.RandomState(2)
    expected = {}
    for split in ("domainbed", "in_domain"):
        for seed in SEEDS:
            for t in TEST_ENVS:
                parts = ("in", "out", "test") if split == "in_domain" else ("in", "out")
                config = {"dataset": DATASET, "algorithm": "erm", "test_envs": [t], "seed": seed}
                config.update(trial_seed=seed, all_test_envs=False, lr=1e-5, split=split, swad=True)
                records = [{"step": 0, **accuracies(rng, (t,), parts)}]
                swad = {"step": 40, **accuracies(rng, (t,), parts)}
                if split == "in_domain":
                    value = np.mean([swad[f"env{e}_test_acc"] for e in range(ENVS) if e != t])
                else:
                    value = swad[f"env{t}_in_acc"]
                expected.setdefault(split, {}).setdefault(seed, []).append(value)
                write_run(tmp_path / f"{split}_{seed}_{t}", Spec(config, records, swad, True, 0))
    report = collect_results.build_report(str(tmp_path))
    line = next(r for r in table(report, "Table 2") if r.startswith("| ERM + SWAD |"))
    cells = [mean_se([np.mean(expected[x][s]) for s in SEEDS]) for x in ("in_domain", "domainbed")]
    assert line == f"| ERM + SWAD | {' | '.join(cells)} |"  # 2 seeds: no t-test arrow


def test_a_swad_record_without_its_marks_is_refused(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    config = {"dataset": DATASET, "algorithm": "erm", "test_envs": [0], "trial_seed": 0, "seed": 0}
    accs = accuracies(np.random.RandomState(0), (0,))
    record = write_record({"step": 0, **accs}, config, folder, 0)
    (folder / "results.jsonl").write_text(json.dumps(record) + "\n")
    (folder / "swad.jsonl").write_text(json.dumps(record) + "\n")  # no "swad"
    (folder / "done").write_text("")
    with pytest.raises(ValueError, match="swad.jsonl: the SWAD record lacks 'swad'"):
        collect_results.build_report(str(tmp_path), strict=True)
    report = collect_results.build_report(str(tmp_path))  # the run's own records stay
    assert f"| ERM | {100 * accs['env0_in_acc']:.1f} ± 0.0 |" in report
    assert "Left out run/swad.jsonl (--strict refuses the report instead): the SWAD" in report
    assert " + SWAD |" not in report


def test_method_order_puts_each_swad_row_after_its_method():
    names = ["SAGM + CORAL", "SAGM + MixStyle + SWAD", "SAGM + SWAD", "ERM (DomainBed)"]
    names += ["SAGM + MixStyle", "SAGM", "ERM + SWAD", "ERM", "Fish + MixStyle + SWAD"]
    names += ["Fish + MixStyle", "Fish"]
    assert sorted(names, key=collect_results.method_order) == [
        "ERM", "ERM + SWAD", "Fish", "Fish + MixStyle", "Fish + MixStyle + SWAD", "SAGM",
        "SAGM + SWAD", "SAGM + MixStyle", "SAGM + MixStyle + SWAD", "SAGM + CORAL",
        "ERM (DomainBed)",
    ]  # fmt: skip


# --- Which setting won ---------------------------------------------------------


def varying_text(h):
    return ", ".join(f"{k}={SETTINGS[h][k]}" for k in sorted(SETTINGS[h]))


@pytest.mark.parametrize("rule", ["training_domain", "leave_one_out"])
def test_winners_name_the_chosen_setting_and_its_folder(sweep_dir, rule):
    report = collect_results.build_report(sweep_dir, rule, winners=True)
    rows = table(report, f"{DATASET}: the chosen setting of each cell")
    assert rows[0] == (
        "| Algorithm | Test env | Trial seed | Validation | Test | Hyperparameters that vary "
        "| Folder |"
    )
    expected = []
    for row, use_swad in (("SAGM", False), ("SAGM", True), ("SAGM + CORAL", False)):
        for t in TEST_ENVS:
            for seed in SEEDS:
                h, val, test = ranking(rule, row, seed, t, use_swad)[0]
                name = row + (" + SWAD" if use_swad else "")
                expected.append(
                    f"| {name} | env{t} | {seed} | {100 * val:.1f} | {100 * test:.1f} | "
                    f"{varying_text(h)} | {path_of(row, seed, h, (t,))} |"
                )
    assert rows[1:] == expected
    assert "the chosen setting" not in collect_results.build_report(sweep_dir, rule)


def test_varying_keys_and_the_only_setting():
    hparams = [{"a": 1, "b": [1]}, {"a": 1, "b": [2]}, {"a": 1, "c": 0}]
    assert collect_results.varying_keys(hparams) == ["b", "c"]  # c: missing from two
    assert collect_results.varying_keys([{"a": 1}]) == []
    assert collect_results.winner_text({"k": {}}, "k") == "(the only setting)"


# --- --top_hparams -------------------------------------------------------------

SELECTION_NAMES = {
    "training_domain": "training-domain validation (DomainBed)",
    "leave_one_out": "leave-one-domain-out cross-validation (DomainBed)",
    "oracle_last": "test-domain validation, last checkpoint (DomainBed's oracle)",
}


def expected_block(row, use_swad, t):
    """The lines of one row's ranking, restated."""
    base = row.removesuffix(" + SWAD")
    lines = ["", f"=== {row} ==="]
    for rule, name in SELECTION_NAMES.items():
        lines += ["", f"Model selection: {name}"]
        for seed in SEEDS:
            lines.append(f"  trial_seed: {seed}")
            for rank, (h, val, test) in enumerate(ranking(rule, base, seed, t, use_swad), 1):
                accs = f"val_acc {val:.4f}, test_acc {test:.4f}"
                lines.append(f"    {rank}. {accs} (hparams_seed {h})")
                config = RUNS[path_of(base, seed, h, (t,))].config
                # The keys that vary between the settings, and the method's.
                keys = [*SETTINGS[0], *(k for k in ("algorithm", "objective") if k in config)]
                lines.append("        hparams:")
                for k in sorted(keys):
                    lines.append(f"        {'*' if k in SETTINGS[0] else ' '} {k}: {config[k]}")
                lines.append("        output_dirs:")
                for envs in [e for e in RUN_ENVS if t in e]:
                    text = ", ".join(map(str, envs))
                    lines.append(f"          {path_of(base, seed, h, envs)} (test envs {text})")
    return lines


def test_top_hparams_ranks_every_setting_as_domainbed(sweep_dir):
    lines = collect_results.top_hparams(sweep_dir, DATASET, "SAGM", 0).splitlines()
    assert lines[0] == f"Total records: {sum(len(s.records) for s in RUNS.values())}"
    n_swad = sum(1 for s in RUNS.values() if s.done and s.swad)
    assert lines[1] == (
        f"Runs: {len(RUNS) - 1} finished, 1 incomplete (not ranked); {n_swad} of them with a "
        "SWAD record"
    )
    assert lines[2] == f"Dataset {DATASET}, test environment env0, rows: SAGM"
    assert lines[4:] == expected_block("SAGM", False, 0)
    # The tie is ranked as DomainBed ranks it: hparams_seed 2 before 1.
    tied = lines.index(f"  trial_seed: {TIE[1]}")
    assert lines[tied + 1].endswith("(hparams_seed 2)")
    assert UNFINISHED not in "\n".join(lines)


def test_top_hparams_of_the_swad_row_and_of_an_algorithm_name(sweep_dir):
    swad = collect_results.top_hparams(sweep_dir, DATASET, "SAGM + SWAD", 1).splitlines()
    assert swad[4:] == expected_block("SAGM + SWAD", True, 1)
    every = collect_results.top_hparams(sweep_dir, DATASET, "sagm", 0).splitlines()
    assert every[2].endswith("rows: SAGM, SAGM + SWAD, SAGM + CORAL")
    expected = []
    for row, use_swad in (("SAGM", False), ("SAGM + SWAD", True), ("SAGM + CORAL", False)):
        expected += expected_block(row, use_swad, 0)
    assert every[4:] == expected


def test_top_hparams_command_line(sweep_dir, capsys):
    argv = ["--input_dir", sweep_dir, "--top_hparams", "--dataset", DATASET]
    argv += ["--algorithm", "SAGM + CORAL"]
    assert collect_results.main([*argv, "--test_env", "0"]) == 0
    expected = collect_results.top_hparams(sweep_dir, DATASET, "SAGM + CORAL", 0)
    assert capsys.readouterr().out == expected
    assert collect_results.main([*argv, "--test_env", "2"]) == 2
    assert "--test_env 2: no run of SAGM + CORAL" in capsys.readouterr().err
    argv[-1] = "MLDG"
    assert collect_results.main([*argv, "--test_env", "0"]) == 2
    error = capsys.readouterr().err
    assert "rows: SAGM, SAGM + SWAD, SAGM + CORAL; recorded algorithms: sagm" in error
    with pytest.raises(SystemExit):
        collect_results.main(argv)  # no --test_env
    with pytest.raises(SystemExit):
        collect_results.main(["--input_dir", sweep_dir, "--dataset", DATASET])  # no --top_hparams
