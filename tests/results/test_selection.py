"""sagm_jax.results.selection: each rule picks a known record from hand-written records, and
the same record from fast records (``eval_splits="fast"``: the all-split records without
the training environments' 'in' keys) as from all-split ones.

Three environments, test environment 0. Accuracies are binary fractions (exact in
floating point), so the ties below are exact ties. Each set of records is written so
that a rule that read the wrong accuracy (the test environment's 'out' part, the
single run's own validation environment, the last step instead of the best) would
pick another record than the one asserted.
"""

import numpy as np
import pytest

from sagm_jax.results import selection


def record(step, in_=(0.5, 0.5, 0.5), out=(0.5, 0.5, 0.5), test=None):
    """A results.jsonl record: ``env{i}_in_acc``, ``env{i}_out_acc`` (and ``_test_acc``)."""
    r = {"step": step, "loss": 1.0}
    for env, (acc_in, acc_out) in enumerate(zip(in_, out)):
        r[f"env{env}_in_acc"], r[f"env{env}_out_acc"] = acc_in, acc_out
    for env, acc in enumerate(test or ()):
        r[f"env{env}_test_acc"] = acc
    return r


# Training-domain validation of each: 0.5, 0.75, 0.75 (a tie, later), 0.375. The test
# environment's 'out' accuracy is highest where the training environments' is lowest.
ONE_RUN = [
    record(0, in_=(0.125, 0.5, 0.5), out=(1.0, 0.5, 0.5)),
    record(100, in_=(0.25, 0.5, 0.5), out=(0.5, 0.625, 0.875)),
    record(200, in_=(0.375, 0.5, 0.5), out=(0.5, 0.875, 0.625)),
    record(300, in_=(0.625, 0.5, 0.5), out=(0.875, 0.25, 0.5)),
]


def test_validation_accuracy_is_the_mean_out_accuracy_of_the_training_envs():
    r = record(0, in_=(1.0, 1.0, 1.0), out=(1.0, 0.25, 0.5))
    assert selection.validation_accuracy(r, [1, 2]) == 0.375
    assert selection.validation_accuracy(r, [2]) == 0.5


def test_training_domain_validation_takes_the_earliest_of_the_best():
    chosen = selection.training_domain_validation(ONE_RUN, [0])
    assert chosen["step"] == 100
    assert chosen["validation_acc"] == 0.75
    assert chosen["env0_in_acc"] == 0.25 and chosen["env2_out_acc"] == 0.875
    assert "loss" not in chosen and "step" in chosen


def test_training_domain_validation_refuses_what_it_cannot_select_from():
    with pytest.raises(ValueError, match="no records"):
        selection.training_domain_validation([], [0])
    with pytest.raises(ValueError, match="leave no training environment"):
        selection.training_domain_validation(ONE_RUN, [0, 1, 2])


def test_training_domain_run_reports_the_test_envs_in_accuracy():
    assert selection.training_domain_run({(0,): ONE_RUN}, 0) == {
        "step": 100,
        "val_acc": 0.75,
        "test_acc": 0.25,
    }
    assert selection.training_domain_run({(0, 1): ONE_RUN}, 0) is None


def test_oracle_last_takes_the_highest_step_whatever_the_order():
    shuffled = [ONE_RUN[2], ONE_RUN[3], ONE_RUN[0], ONE_RUN[1]]
    assert selection.oracle_last_run({(0,): shuffled}, 0) == {
        "step": 300,
        "val_acc": 0.875,
        "test_acc": 0.625,
    }


def test_oracle_best_takes_the_earliest_best_test_env_out_accuracy():
    records = [*ONE_RUN, record(400, in_=(0.75, 0.5, 0.5), out=(1.0, 0.5, 0.5))]
    assert selection.oracle_best_run({(0,): records}, 0) == {
        "step": 0,
        "val_acc": 1.0,
        "test_acc": 0.125,
    }


def leave_one_out_runs():
    """Single run (0,) and the pair runs (0, 1), (0, 2). Validation of step s is the mean
    of env1_in of run (0, 1) and env2_in of run (0, 2): step 0: 0.5, step 100: skipped
    (run (0, 2) has no record there, though run (0, 1)'s 1.0 would win), step 200: 0.5
    (a tie, later), step 300: 0.25. The single run's own accuracies favour step 300."""
    single = [
        record(s, in_=(acc, acc, acc), out=(0.5, acc, acc))
        for s, acc in ((0, 0.125), (100, 0.25), (200, 0.375), (300, 0.625))
    ]
    pair_1 = [
        record(s, in_=(0.0, acc, 0.0), out=(0.0, 0.0, 1.0))
        for s, acc in ((0, 0.75), (100, 1.0), (200, 0.25), (300, 0.25))
    ]
    pair_2 = [
        record(s, in_=(0.0, 0.0, acc), out=(0.0, 1.0, 0.0))
        for s, acc in ((0, 0.25), (200, 0.75), (300, 0.25))
    ]
    return {(0,): single, (0, 1): pair_1, (0, 2): pair_2}


def test_leave_one_out_scores_each_step_by_the_held_out_envs_of_the_pair_runs():
    assert selection.leave_one_out_run(leave_one_out_runs(), 0) == {
        "step": 0,
        "val_acc": 0.5,
        "test_acc": 0.125,
    }


def test_leave_one_out_needs_every_pair_run_at_a_step():
    runs = leave_one_out_runs()
    runs[(0, 1)] = [r for r in runs[(0, 1)] if r["step"] != 0]
    # Step 0 lacks run (0, 1) now; step 200 is the earliest of what is left.
    assert selection.leave_one_out_run(runs, 0)["step"] == 200
    del runs[(0, 2)]
    assert selection.leave_one_out_run(runs, 0) is None
    assert selection.leave_one_out_run({(0, 1): runs[(0, 1)]}, 0) is None


def test_in_domain_scores_the_training_envs_test_parts_of_the_selected_step():
    # The 'out' parts of ONE_RUN (step 100 selected); a rule that averaged the test
    # environment's 'test' part in too would report 0.75.
    tests = [(1.0, 0.25, 0.25), (1.0, 0.5, 0.75), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)]
    records = [
        record(r["step"], out=tuple(r[f"env{e}_out_acc"] for e in range(3)), test=test)
        for r, test in zip(ONE_RUN, tests)
    ]
    assert selection.in_domain_run({(0,): records}, 0) == {
        "step": 100,
        "val_acc": 0.75,
        "test_acc": 0.625,
    }
    with pytest.raises(ValueError, match="in_domain"):
        selection.in_domain_run({(0,): ONE_RUN}, 0)


def test_sweep_selection_takes_the_first_setting_with_the_best_validation():
    better = [record(0, out=(0.0, 0.875, 0.875))]
    settings = {
        "worse": {(0,): ONE_RUN},  # 0.75
        "better": {(0,): better},
        "tied with better": {(0,): [record(5, out=(0.0, 0.875, 0.875))]},
        "no single run": {(0, 1): [record(0, out=(0.0, 1.0, 1.0))]},
    }
    chosen = selection.sweep_selection(selection.training_domain_run, settings, 0)
    assert chosen == {"step": 0, "val_acc": 0.875, "test_acc": 0.5, "setting": "better"}
    assert selection.sweep_selection(selection.training_domain_run, {"none": {}}, 0) is None


def test_rank_settings_keeps_the_callers_order_of_ties_and_drops_the_unscorable():
    """DomainBed's list_top_hparams order: by validation accuracy, best first; of equal
    ones the caller's order (collect_results passes them largest hparams_seed first)."""

    def run(out1, out2):
        return {(0,): [record(0, out=(0.5, out1, out2))]}

    settings = {
        "a": run(0.5, 0.5),
        "b": run(0.75, 0.75),
        "no single run": {(0, 1): [record(0, out=(0.0, 1.0, 1.0))]},
        "d": run(1.0, 0.5),  # ties with b
        "e": run(0.25, 0.5),
    }
    ranked = selection.rank_settings(selection.training_domain_run, settings, 0)
    assert [(c["setting"], c["val_acc"]) for c in ranked] == [
        ("b", 0.75),
        ("d", 0.75),
        ("a", 0.5),
        ("e", 0.375),
    ]
    assert ranked[1] == {"step": 0, "val_acc": 0.75, "test_acc": 0.5, "setting": "d"}
    assert selection.sweep_selection(selection.training_domain_run, settings, 0) == ranked[0]
    assert selection.rank_settings(selection.leave_one_out_run, settings, 0) == []


def test_every_rule_has_a_name_for_the_tables():
    assert set(selection.RUN_SELECTIONS) == set(selection.SELECTION_NAMES)


# --- fast records (config.eval_splits="fast") ------------------------------------------


def fast(records, test_envs):
    """The records as ``eval_splits="fast"`` writes them, by the rule written out here
    (SWAD's evaluator's): without the 'in' accuracy and loss of every environment that is
    not one of the run's ``test_envs``."""
    dropped = {
        f"env{e}_in_{what}" for e in range(4) if e not in test_envs for what in ("acc", "loss")
    }
    return [{k: v for k, v in r.items() if k not in dropped} for r in records]


def random_settings(seed, split):
    """Three settings of four environments, test environment 1: each a single run (1,)
    and its pair runs (1, v), four evaluations each (one pair run misses a step).
    Accuracies are multiples of 1/8, so validation accuracies tie often."""
    rng = np.random.default_rng(seed)
    parts = ("in", "out", "test") if split == "in_domain" else ("in", "out")

    def run(n_steps=4):
        records = []
        for step in range(0, 100 * n_steps, 100):
            r = {"step": step, "loss": 1.0}
            for env in range(4):
                for part in parts:
                    r[f"env{env}_{part}_acc"] = int(rng.integers(0, 9)) / 8
                    r[f"env{env}_{part}_loss"] = float(rng.uniform(0, 2))
            records.append(r)
        return records

    settings = {}
    for name in ("a", "b", "c"):
        runs = {(1,): run()}
        for v in (0, 2, 3):
            runs[tuple(sorted((1, v)))] = run()
        settings[name] = runs
    settings["b"][(1, 3)] = settings["b"][(1, 3)][:3]
    return settings


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("split", ["domainbed", "in_domain"])
def test_every_rule_chooses_alike_from_fast_and_all_split_records(seed, split):
    settings = random_settings(seed, split)
    fast_settings = {
        name: {envs: fast(records, envs) for envs, records in runs.items()}
        for name, runs in settings.items()
    }
    single = settings["a"][(1,)]
    assert "env0_in_acc" in single[0] and "env0_in_acc" not in fast_settings["a"][(1,)][0]
    assert "env3_in_acc" in fast_settings["a"][(1, 3)][0]  # a pair run's validation env
    rules = list(selection.RUN_SELECTIONS.values())
    rules += [selection.in_domain_run] if split == "in_domain" else []
    for rule in rules:
        for name in settings:
            expected = rule(settings[name], 1)
            assert expected is not None
            assert rule(fast_settings[name], 1) == expected, (rule.__name__, name)
        assert selection.rank_settings(rule, fast_settings, 1) == selection.rank_settings(
            rule, settings, 1
        )
    chosen = selection.training_domain_validation(single, [1])
    dropped = {f"env{e}_in_acc" for e in (0, 2, 3)}
    assert selection.training_domain_validation(fast(single, (1,)), [1]) == {
        k: v for k, v in chosen.items() if k not in dropped
    }


def test_a_missing_accuracy_a_rule_needs_is_named_not_averaged_over():
    settings = random_settings(0, "in_domain")["a"]
    for envs in settings:
        settings[envs] = fast(settings[envs], envs)
    no_test_part = {
        (1,): [{k: v for k, v in r.items() if k != "env2_test_acc"} for r in settings[(1,)]]
    }
    with pytest.raises(ValueError, match="no env2_test_acc; model selection needs it"):
        selection.in_domain_run(no_test_part, 1)
    no_validation = dict(settings)
    no_validation[(1, 3)] = fast(settings[(1, 3)], (1,))  # its env3 'in' dropped
    no_validation[(1, 3)][0]["config"] = {"eval_splits": "fast"}
    with pytest.raises(ValueError, match=r"step 0 has no env3_in_acc \(config.eval_splits=fast"):
        selection.leave_one_out_run(no_validation, 1)
    with pytest.raises(ValueError, match="no env1_in_acc"):
        selection.oracle_last_run({(1,): fast(settings[(1,)], ())}, 1)
