"""The tables with every method: row names from ``sagm_jax.methods``, the paper's row
order, Table 2's rows and its significance arrows, and leave-one-domain-out without
pair runs.

The sweep is made here, DomainBed-shaped as ``make_golden_records.py`` makes the
goldens' (``results.jsonl`` with ``args``, ``hparams`` and ``config``; ``done``), with
ONE checkpoint and one setting per run, so the chosen accuracy of a run is its record's
and this test restates the cells without the selection code: a seed's out-of-domain
value is the mean of ``env{t}_in_acc`` over the test environments t, its in-domain value
the mean over t of the training environments' mean ``env{i}_test_acc``. The arrows are
restated as Welch's t-test in float64 NumPy, with only the t distribution's tail from
scipy.
"""

import json
import runpy

import numpy as np
import pytest
import scipy.stats

from sagm_jax.results import collect as collect_results
from test_pair_jobs import dry_run_jobs, note_commands

ENVS, TEST_ENVS, SEEDS = 4, (0, 1), (0, 1, 2, 3)
# row -> (config of its runs, accuracy level, trial seeds, with in-domain runs)
METHODS = {
    "ERM": ({"algorithm": "erm"}, 0.80, SEEDS, True),
    "ERM + Mixup": ({"algorithm": "erm", "objective": "mixup"}, 0.80, SEEDS, True),
    "Fish": ({"algorithm": "fish"}, 0.74, SEEDS, True),
    "SAGM + MixStyle": ({"algorithm": "sagm", "mixstyle": True}, 0.85, SEEDS, False),
    "SAGM + CORAL": ({"algorithm": "sagm", "objective": "coral"}, 0.86, SEEDS, True),
    "DISAM on SAGM": ({"algorithm": "sagm", "disam_lambda": 0.1}, 0.90, (0,), True),
}


def make_runs():
    """``[(row, path, config, record)]``: one finished run per method, split, test environment
    and trial seed. ERM's seeds 0 and 1 are records written before objectives existed
    (no ``objective``, no ``disam_lambda``); its seeds 2 and 3 name them."""
    rng = np.random.RandomState(18)
    runs = []
    for row, (method, level, seeds, in_domain) in METHODS.items():
        for split in ("domainbed", "in_domain") if in_domain else ("domainbed",):
            for t in TEST_ENVS:
                for seed in seeds:
                    config = {
                        "dataset": "PACS",
                        "test_envs": [t],
                        "all_test_envs": False,
                        "trial_seed": seed,
                        "seed": seed,
                        "lr": 3e-5,
                        "mixstyle": False,
                        "pretrained_weights": "none",  # passes the sweep's checks
                        "split": split,
                        **method,
                    }
                    if row == "ERM" and seed >= 2:
                        config.update(objective="erm", disam_lambda=0.0)
                    record = {"step": 0}
                    for env in range(ENVS):
                        parts = ("in", "out") + (("test",) if split == "in_domain" else ())
                        for part in parts:
                            shift = -0.1 if env == t else 0.0
                            accuracy = level + shift + rng.normal(0, 0.015)
                            record[f"env{env}_{part}_acc"] = round(float(accuracy), 4)
                    path = "_".join([split, row.replace(" ", ""), f"t{t}", f"s{seed}"])
                    runs.append((row, path, config, record))
    return runs


RUNS = make_runs()
# Table 1's rows of the averagings across runs, after the paper's: the published average
# and its source, as the DiWA README (alexrame/diwa, "LP" init rows: "Restricted" is the
# greedy soup, "DiWA†" the soup of the 60 runs of 3 data splits) and the Model
# Ratatouille README (facebookresearch/ModelRatatouille) print them; EoA's README prints
# its table as an image and no README of ERM++ prints its figures.
AVERAGINGS_PUBLISHED = {
    "DiWA (uniform)": ("67.6", "DiWA README, uniform, LP init"),
    "DiWA (greedy)": ("67.5", "DiWA README, restricted, LP init"),
    "DiWA (uniform, 3 splits)": ("68.0", "DiWA README, DiWA† uniform, LP init"),
    "Ratatouille (uniform)": ("68.1", "Ratatouille README, uniform"),
    "Ratatouille (greedy)": ("67.9", "Ratatouille README, greedy"),
    "Ratatouille (uniform, 3 splits)": ("68.3", "Ratatouille README, uniform†"),
    "EoA": ("-", "EoA paper; its README's table is an image"),
    "ERM++": ("-", "ERM++ paper; no README prints its figures"),
}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods_sweep")
    for _, path, config, record in RUNS:
        folder = root / path
        folder.mkdir()
        args = {k: config[k] for k in ("dataset", "test_envs", "trial_seed", "seed")}
        args.update(algorithm=config["algorithm"], output_dir=str(folder), hparams_seed=0)
        hparams = {"lr": config["lr"], "mixstyle": config["mixstyle"]}
        line = json.dumps({**record, "args": args, "hparams": hparams, "config": config})
        (folder / "results.jsonl").write_text(line + "\n")
        (folder / "done").write_text("")
    return str(root)


def per_seed(row, split):
    """The row's per-seed values of the split (fractions), restated from the records."""
    values = []
    for seed in METHODS[row][2]:
        per_env = []
        for run_row, _, config, record in RUNS:
            if (run_row, config["split"], config["trial_seed"]) != (row, split, seed):
                continue
            t = config["test_envs"][0]
            if split == "domainbed":
                per_env.append(record[f"env{t}_in_acc"])
            else:
                training = [i for i in range(ENVS) if i != t]
                per_env.append(np.mean([record[f"env{i}_test_acc"] for i in training]))
        assert len(per_env) == len(TEST_ENVS)
        values.append(np.mean(per_env))
    return np.array(values, dtype=np.float64)


def welch_p(x, y):
    """Welch's two-sided p: t over the unpooled s.e., Welch-Satterthwaite degrees of
    freedom, both tails of Student's t."""
    vx, vy = np.var(x, ddof=1) / len(x), np.var(y, ddof=1) / len(y)
    t = (np.mean(x) - np.mean(y)) / np.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    return 2 * scipy.stats.t.sf(abs(t), df)


def expected_cell(row, split, arrows):
    if row not in METHODS or (split == "in_domain" and not METHODS[row][3]):
        return "-"
    x = per_seed(row, split)
    pct = 100 * x
    text = f"{pct.mean():.1f} ± {pct.std() / np.sqrt(len(x)):.1f}"
    text += f" ({len(x)}/{len(SEEDS)})" if len(x) < len(SEEDS) else ""
    if row != "ERM" and len(x) >= 2:
        reference = per_seed("ERM", split)
        if welch_p(x, reference) < 0.05:
            arrow = "↑" if x.mean() > reference.mean() else "↓"
            arrows.add(arrow)
            text += " " + arrow
        else:
            arrows.add("")
    return text


def table(report, title):
    """The rows of the Markdown table whose heading starts with ``title``."""
    block = next(b for b in report.split("### ") if b.startswith(title))
    return [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]


def test_method_names_come_from_the_methods_table():
    def name(config):
        record = {"args": {"algorithm": config["algorithm"]}, "config": config}
        return collect_results.method_name(record)

    assert name({"algorithm": "sagm"}) == "SAGM"  # an old record: objective erm, no DISAM
    assert name({"algorithm": "erm", "objective": "cutmix"}) == "ERM + CutMix"
    assert name({"algorithm": "erm", "objective": "groupdro"}) == "GroupDRO"
    assert name({"algorithm": "and_mask", "objective": "erm"}) == "AND-mask"
    assert name({"algorithm": "sagm", "objective": "coral", "disam_lambda": 0.1}) == (
        "DISAM on SAGM + CORAL"
    )
    assert name({"algorithm": "erm", "mixstyle": True, "disam_lambda": 0}) == "ERM + MixStyle"
    # The SAGM repository's cross-domain MixStyle is a row of its own.
    crossdomain = {"algorithm": "sagm", "mixstyle": True, "mixstyle_mix": "crossdomain"}
    assert name(crossdomain) == "SAGM + Mixstyle2"
    assert name({**crossdomain, "mixstyle": False}) == "SAGM"
    assert name({"algorithm": "sagm", "objective": "selfreg"}) == "SAGM + SelfReg"
    assert name({"algorithm": "erm", "objective": "arm"}) == "ARM"


def test_rows_follow_the_papers_order():
    order = collect_results.ROW_ORDER
    paper = [
        "ERM", "ERM + Mixup", "ERM + CutMix", "ERM + MixStyle", "Fish", "AND-mask", "MLDG",
        "CORAL", "MMD", "GroupDRO", "IRM", "VREx", "SAM", "GSAM", "ERM + SAM", "SAGM",
        "SAGM + MixStyle", "SAGM + CORAL", "DISAM on SAGM", "DISAM on SAGM + CORAL",
    ]  # fmt: skip
    assert [order.index(row) for row in paper] == sorted(order.index(row) for row in paper)
    assert len(set(order)) == len(order)
    assert "DISAM on ERM + SAM" not in order and "Fish + Mixup" not in order  # refused
    assert collect_results.TABLE_2_ROWS == (
        "ERM", "ERM + Mixup", "ERM + CutMix", "ERM + MixStyle", "Fish", "AND-mask", "MLDG",
        "SAM", "GSAM", "SAGM", "SAGM + MixStyle",
    )  # fmt: skip
    # A MixStyle row the order does not list follows its method; unknown names come last.
    names = ["ERM (DomainBed)", "Fish + MixStyle", "MLDG", "Fish", "ERM"]
    assert sorted(names, key=collect_results.method_order) == [
        "ERM", "Fish", "Fish + MixStyle", "MLDG", "ERM (DomainBed)",
    ]  # fmt: skip


def test_table_2_has_every_paper_row_and_welch_arrows(sweep_dir):
    report = collect_results.build_report(sweep_dir, "training_domain")
    rows = table(report, "Table 2")
    assert rows[0] == "| Algorithm | PACS in-domain | PACS out-of-domain |"
    names = [*collect_results.TABLE_2_ROWS, "SAGM + CORAL", "DISAM on SAGM"]
    arrows = set()
    expected = [
        f"| {row} | {expected_cell(row, 'in_domain', arrows)} | "
        f"{expected_cell(row, 'domainbed', arrows)} |"
        for row in names
    ]
    assert rows[1:] == expected
    assert arrows == {"↑", "↓", ""}  # the data exercise every case
    # DISAM on SAGM is far above ERM, but over one seed: no test, no arrow.
    assert rows[-1].endswith("(1/4) |")
    assert "Welch's two-sided t-test" in report.split("### Table 2")[1].split("###")[0]
    latex = collect_results.build_report(sweep_dir, "training_domain", latex=True)
    assert "SAGM + CORAL & " in latex and "$\\uparrow$" in latex and "$\\downarrow$" in latex


def test_the_arrow_is_welchs_not_students():
    """Unequal variances and sizes, where the pooled-variance (Student) test would call a
    difference that Welch's does not; and a clear difference both ways."""
    steady, scattered = [0.80, 0.81, 0.80, 0.81, 0.80, 0.81], [0.72, 0.79, 0.74]
    assert welch_p(np.array(steady), np.array(scattered)) > 0.05
    assert scipy.stats.ttest_ind(steady, scattered).pvalue < 0.05  # Student's
    assert collect_results.significance_arrow(steady, scattered, latex=False) == ""
    lower = [0.70, 0.71, 0.70]
    assert welch_p(np.array(steady), np.array(lower)) < 0.05
    assert collect_results.significance_arrow(steady, lower, latex=False) == "↑"
    assert collect_results.significance_arrow(lower, steady, latex=True) == "$\\downarrow$"
    assert collect_results.significance_arrow(lower[:1], steady, latex=False) == ""
    assert collect_results.significance_arrow([0.8, 0.8], [0.8, 0.8], latex=False) == ""


def test_tables_1_and_per_dataset_list_the_new_rows_in_order(sweep_dir):
    """Table 1: every row of the paper's Table 1 in its order, "-" without runs, a
    MixStyle row after its method, then the sweep's other rows; the per-dataset tables:
    the sweep's rows in the tables' order."""
    report = collect_results.build_report(sweep_dir, "training_domain")
    order = ["ERM", "ERM + Mixup", "Fish", "SAGM + MixStyle", "SAGM + CORAL", "DISAM on SAGM"]
    assert [r.split(" | ")[0][2:] for r in table(report, "PACS")[1:]] == order
    paper = [
        "MMD",
        "ERM + MixStyle",
        "GroupDRO",
        "IRM",
        "ARM",
        "VREx",
        "CDANN",
        "AND-mask",
        "DANN",
        "RSC",
        "MTL",
        "ERM + Mixup",
        "MLDG",
        "ERM",
        "Fish",
        "SagNet",
        "SelfReg",
        "CORAL",
        "mDSDI",
        "MIRO",
        "SAM",
        "GSAM",
        "SAGM",
    ]
    rows = table(report, "Table 1")[1:]
    assert [r.split(" | ")[0][2:] for r in rows] == paper + ["SAGM + MixStyle"] + [
        *AVERAGINGS_PUBLISHED,
        "SAGM + CORAL",
        "DISAM on SAGM",
    ]
    published = {r.split(" | ")[0][2:]: r.split(" | ")[-1].rstrip(" |") for r in rows}
    assert published["SAGM"] == "66.1 (SAGM paper)" and published["DANN"] == "62.6 (DomainBed)"
    assert published["MIRO"] == "65.9 (MIRO README)" and published["SelfReg"] == "-"
    for row, (average, source) in AVERAGINGS_PUBLISHED.items():
        assert published[row] == f"{average} ({source})"
    assert rows[paper.index("SAGM") + 1].split(" | ")[1] != "-"  # SAGM + MixStyle ran
    fish = 100 * per_seed("Fish", "domainbed")
    assert f"| Fish | {fish.mean():.1f} ± {fish.std() / 2:.1f} | {fish.mean():.1f} |" in report


def test_leave_one_out_without_pairs_says_what_is_missing_and_the_command(sweep_dir, capsys):
    report = collect_results.build_report(sweep_dir, "leave_one_out")
    for title in ("Table 1", "PACS", "Table 3"):
        block = report.split(f"### {title}\n\n", 1)[1]
        assert block.startswith("No entry: the sweep has no pair runs")
    note = report.split("Leave-one-domain-out needs")[1]
    for row in METHODS:
        assert f"{row} (test environments 0, 1)" in note
    # The suggested commands launch exactly the pair runs of each run's own config: the
    # job of its config file (configs/pacs.py) with the keys its config changes of the
    # file's, with the pair's test environments; read back from their --dry_run.
    defaults = runpy.run_path("configs/pacs.py")["get_config"]().to_dict()
    expected = []
    for _, _, config, _ in RUNS:
        if config["split"] != "domainbed":
            continue
        t = config["test_envs"][0]
        for v in sorted(set(range(ENVS)) - {t}):
            args = {"config": "configs/pacs.py", "test_envs": sorted([t, v])}
            args.update({k: v for k, v in config.items() if k not in ("dataset", "test_envs")})
            args.pop("all_test_envs")
            for key, default in {"objective": "erm", "disam_lambda": 0.0, **defaults}.items():
                if key not in ("algorithm", "trial_seed", "seed") and args.get(key) == default:
                    args.pop(key, None)
            if args not in expected:
                expected.append(args)
    launched = [args for c in note_commands(report) for _, args in dry_run_jobs(c, capsys)]
    key = lambda args: json.dumps(args, sort_keys=True)  # noqa: E731
    assert sorted(launched, key=key) == sorted(expected, key=key)
    # Training-domain validation needs no pairs: no such note.
    assert "Leave-one-domain-out needs" not in collect_results.build_report(sweep_dir)


def test_averagings_of_other_members_follow_their_averagings_row_in_table_1():
    """Soup rows ("SAGM + DiWA (uniform)", "SAGM + CORAL + EoA") land right after their
    averaging's row, the ERM soup's cell being the mean over trial seeds of the mean over
    test environments, its s.e. the population std over sqrt(seeds) (restated here)."""
    from sagm_jax.results import tables

    accuracies = {  # row -> {(trial seed, test env): accuracy}
        "DiWA (uniform)": {(0, 0): 0.90, (0, 1): 0.80, (1, 0): 0.86, (1, 1): 0.78},
        "SAGM + DiWA (uniform)": {(0, 0): 0.91, (0, 1): 0.82, (1, 0): 0.88, (1, 1): 0.80},
        "SAGM + CORAL + EoA": {(0, 0): 0.70, (0, 1): 0.60, (1, 0): 0.72, (1, 1): 0.64},
        "SAGM": {(0, 0): 0.85, (0, 1): 0.75, (1, 0): 0.83, (1, 1): 0.77},
    }
    chosen, groups = {}, {}
    for row, values in accuracies.items():
        for (seed, env), accuracy in values.items():
            chosen["domainbed", "PACS", row, seed, env] = accuracy
            groups["domainbed", "PACS", row, seed, env] = {"setting": [(env,)]}
    sweep = tables.Sweep(chosen, groups, "domainbed")
    rows = tables.table_1(sweep, "training-domain validation", False, "±").splitlines()[4:]
    names = [r.split(" | ")[0][2:] for r in rows]
    diwa = names.index("DiWA (uniform)")
    assert names[diwa + 1 : diwa + 3] == ["SAGM + DiWA (uniform)", "DiWA (greedy)"]
    assert names[names.index("EoA") + 1] == "SAGM + CORAL + EoA"
    assert names.index("SAGM") < diwa and names[-1] == "ERM++"
    for row, values in accuracies.items():
        per_seed = 100 * np.array([np.mean([values[s, 0], values[s, 1]]) for s in (0, 1)])
        cell = f"{per_seed.mean():.1f} ± {np.std(per_seed) / np.sqrt(2):.1f}"
        assert rows[names.index(row)].startswith(f"| {row} | {cell} | {per_seed.mean():.1f} |")
    assert rows[diwa].endswith("| 67.6 (DiWA README, uniform, LP init) |")
    assert rows[diwa + 1].endswith("| - |")  # no published SAGM + DiWA row


def test_a_soups_record_lands_in_its_row_of_table_1(tmp_path):
    """Runs whose config names a combined run's label (``rundir.COMBINED_LABEL``, as a soup's
    run directory holds it) fill that row: the ERM soup's "DiWA (uniform)" among the
    published rows, the SAGM soup's "SAGM + DiWA (uniform)" right after it; each cell the
    mean over trial seeds of the mean over test environments of ``env{t}_in_acc`` (one
    record per run, so the selection has one choice), restated here in float64."""
    from sagm_jax.training import rundir

    rng = np.random.RandomState(7)
    expected = {}
    for label, algorithm, level in (("DiWA (uniform)", "erm", 0.82),
                                    ("SAGM + DiWA (uniform)", "sagm", 0.86)):
        per_seed = []
        for seed in (0, 1):
            per_env = []
            for t in TEST_ENVS:
                config = {"dataset": "PACS", "test_envs": [t], "all_test_envs": False,
                          "trial_seed": seed, "seed": seed, "lr": 3e-5, "mixstyle": False,
                          "pretrained_weights": "none", "split": "domainbed",
                          "algorithm": algorithm, rundir.COMBINED_LABEL: label}
                record = {"step": 0, **{f"env{e}_{part}_acc": round(level + rng.normal(0, 0.02), 4)
                                        for e in range(ENVS) for part in ("in", "out")}}
                per_env.append(record[f"env{t}_in_acc"])
                folder = tmp_path / f"{algorithm}_t{t}_s{seed}"
                folder.mkdir()
                args = {"dataset": "PACS", "test_envs": [t], "trial_seed": seed, "seed": seed,
                        "algorithm": label, "output_dir": str(folder), "hparams_seed": 0}
                line = json.dumps({**record, "args": args, "hparams": {}, "config": config})
                (folder / "results.jsonl").write_text(line + "\n")
                (folder / "done").write_text("")
            per_seed.append(np.mean(per_env))
        expected[label] = 100 * np.array(per_seed, dtype=np.float64)
    rows = table(collect_results.build_report(str(tmp_path), "training_domain"), "Table 1")[1:]
    names = [r.split(" | ")[0][2:] for r in rows]
    diwa = names.index("DiWA (uniform)")
    assert names[diwa + 1] == "SAGM + DiWA (uniform)"
    for offset, (label, values) in enumerate(expected.items()):
        cell = f"{values.mean():.1f} ± {values.std() / np.sqrt(2):.1f}"
        assert rows[diwa + offset].startswith(f"| {label} | {cell} | {values.mean():.1f} |")
