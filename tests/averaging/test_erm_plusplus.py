"""sagm_jax.averaging.erm_plusplus: ERM++'s learning-rate plateau (torch's
ReduceLROnPlateau as train_autolr.py steps it) against a NumPy re-statement of torch's
rule, and the two stages on a tiny RotatedDigits run: stage 1 stops at the third change,
stage 2 replays its schedule and stops where it stopped."""

import itertools
import math
import os

import numpy as np
import pytest
from run_fixtures import digits_config

from sagm_jax.averaging import erm_plusplus, lr_plateau
from sagm_jax.config import presets


def torch_plateau(losses, lr, factor=0.1, patience=1, threshold=1e-4, eps=1e-8):
    """torch.optim.lr_scheduler.ReduceLROnPlateau(opt, 'min', patience=1).step(l) for
    each loss, re-stated from torch's source (mode 'min', threshold_mode 'rel',
    cooldown 0, min_lr 0), then DomainBed's ERMPlusPlus.set_lr: a change whenever the lr
    differs from the previous evaluation's, the third sets it to 0. Returns the lr after
    each loss up to and including the third change."""
    best, bad, out, changes = np.inf, 0, [], 0
    for loss in losses:
        if loss < best * (1.0 - threshold):  # torch's _is_better, mode min, rel
            best, bad = loss, 0
        else:
            bad += 1
        if bad > patience:
            new = max(lr * factor, 0.0)
            if lr - new > eps:
                lr = new
            bad = 0
        if out and lr != out[-1]:
            changes += 1
        out.append(0.0 if changes == 3 else lr)
        if changes == 3:
            break
    return out


@pytest.mark.parametrize("losses", [
    [1.0, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7],
    [2.0, 2.0 * (1 - 1e-4), 2.0 * (1 - 1e-4), 2.0 * (1 - 0.5e-4), 1.0, 1.0, 1.0, 1.0, 1.0],
    list(np.random.default_rng(0).uniform(0.5, 1.5, 30)),
])
def test_the_plateau_decides_as_torch(losses):
    lr = 5e-5
    want = torch_plateau(losses, lr)
    plateau, got = lr_plateau.ReduceLROnPlateau(lr), []
    for loss in losses[: len(want)]:
        got.append(plateau.step(loss))
    factors = lr_plateau.LearningRateRun(
        digits_config(lr=lr, linear_steps=0, lr_plateau=True), [1], [
            {"step": t, "env1_out_loss": loss} for t, loss in enumerate(losses)]).factors
    assert [f * lr for f in factors] == pytest.approx(want, rel=1e-12)
    # The scheduler alone never sets 0; set_lr's third change does.
    assert got[: len(want) - 1] == pytest.approx(want[:-1], rel=1e-12)
    changes = sum(a != b for a, b in itertools.pairwise(want))
    assert (want[-1] == 0.0) == (changes == 3)


def test_the_plateau_waits_for_the_linear_phase():
    """Evaluations before the last linear update do not step the plateau (ERMPlusPlus
    set_lr acts once global_iter = step + 1 > the reference's linear_steps)."""
    config = digits_config(lr=1.0, linear_steps=5, lr_plateau=True)
    records = [{"step": t, "env1_out_loss": 1.0} for t in range(0, 12, 2)]
    run = lr_plateau.LearningRateRun(config, [1], records)
    assert len(run.factors) == len([t for t in range(0, 12, 2) if t + 1 >= 5])


def test_the_preset_sets_ermplusplus_defaults():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "rotated_digits.py")
    spec = importlib.util.spec_from_file_location("rotated_digits_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("erm_plusplus")  # configs/rotated_digits.py:erm_plusplus
    assert (config.linear_steps, config.linear_lr) == (501, 5e-5)
    assert config.moving_average and config.moving_average_start == 600
    assert config.lr_plateau and config.algorithm == "erm"
    images = presets.apply(digits_config(arch="resnet50"), "erm_plusplus")
    assert images.arch == "resnet50_augmix" and images.freeze_batchnorm is False
    assert images.moving_average_batchnorm_forward is True
    assert (images.lr, images.weight_decay, images.batch_per_env, images.dropout) == (
        5e-5, 0.0, 32, 0.0)


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """ERM++ on RotatedDigits with so small a learning rate that the validation loss
    never improves by 1e-4: the plateau changes the lr every other evaluation."""
    config = ermpp_config()
    workdir = str(tmp_path_factory.mktemp("ermpp"))
    # Stage 2 on stage 1's split, so that its replay can be compared with stage 1.
    return erm_plusplus.train_erm_plusplus(config, workdir, full_data=False), workdir


def ermpp_config():
    return digits_config(
        algorithm="erm", lr=5e-6, linear_steps=2, linear_lr=1e-7, moving_average=True,
        moving_average_start=3, steps=41, eval_every=1)


def test_stage_one_stops_at_the_third_change_and_stage_two_replays(two_stages):
    result, workdir = two_stages
    stage1, stage2 = result["stage1"], result["stage2"]
    train_envs = [1, 2, 3, 4, 5]
    eligible = [r for r in stage1 if r["step"] + 1 >= 2]
    losses = [np.mean([r[f"env{e}_out_loss"] for e in train_envs]) for r in eligible]
    want = torch_plateau(losses, 5e-6)
    assert want[-1] == 0.0 and len(want) == len(losses)  # stopped at the third change
    assert stage1[-1]["step"] == eligible[len(want) - 1]["step"] < 40
    assert result["steps"] == stage1[-1]["step"] + 1
    assert [f * 5e-6 for f in result["schedule"]] == pytest.approx(want, rel=1e-9)
    # Stage 2 (the same split and seeds here) replays stage 1's learning rates: its
    # records are stage 1's, step for step, and it ends where stage 1 ended.
    assert [r["step"] for r in stage2] == [r["step"] for r in stage1]
    for a, b in zip(stage1, stage2):
        assert {k: v for k, v in a.items() if k.endswith("_acc")} == {
            k: v for k, v in b.items() if k.endswith("_acc")}
    assert stage2[-1]["args"]["algorithm"] == "ERM++"
    assert stage1[-1]["args"]["algorithm"] == "ERM"
    assert os.path.exists(os.path.join(workdir, "stage2", "done"))
    assert math.isfinite(result["test_acc"])


def test_the_plateau_is_not_packed():
    from sagm_jax.training import packed

    base = digits_config(lr_plateau=True).to_dict()
    assert any(p.startswith("lr_plateau/lr_schedule") for p in packed.program_problems(
        [base, {**base, "seed": 1}]))


def test_stage_two_trains_on_every_example():
    """Stage 2's split (train_autolr.py's holdout_fraction 0): every environment's 'in'
    is the whole environment; its 'out' is DomainBed's 'out' (inside 'in')."""
    from sagm_jax import data as data_lib
    from sagm_jax.data import splits

    config = digits_config(lr_plateau=False, linear_steps=2)
    first, second = erm_plusplus.stage_configs(config)
    config2 = second([{"step": 0, "env1_out_loss": 1.0}, {"step": 4, "env1_out_loss": 1.0}], [1])
    assert config2.split == "full_data" and config2.steps == 5
    assert config2.lr_schedule == (1.0,) and first.lr_plateau  # step 0 is in the probe
    full = data_lib.from_config(config2)
    held = data_lib.from_config(config)
    for env, parts in enumerate(full.splits):
        n = len(held.splits[env]["in"]) + len(held.splits[env]["out"])
        assert sorted(parts["in"]) == list(range(n))
        assert list(parts["out"]) == list(held.splits[env]["out"])
    assert list(splits.full_data_split(10, 0, 1)["in"]) == list(splits.shuffled_keys(10, 0, 1))


def test_stage_one_interrupted_after_a_change_resumes_exactly(two_stages, tmp_path,
                                                              monkeypatch):
    """Stopped (KeyboardInterrupt) after the checkpoint of its first lr change, stage 1
    relaunched ends as the uninterrupted stage 1: the factor comes back with the
    checkpoint, the plateau's counters from replaying the recorded losses."""
    from sagm_jax.training import checkpoints as checkpoints_lib
    from sagm_jax.training.train import train_one_run

    result, _ = two_stages
    first, _ = erm_plusplus.stage_configs(ermpp_config())
    save, saves = checkpoints_lib.Checkpoints.save, []

    def save_then_stop(self, *args, **kwargs):
        save(self, *args, **kwargs)
        saves.append(args[0])
        if len(saves) == 4:  # the checkpoint of step 3, where the first change came
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints_lib.Checkpoints, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train_one_run(first, str(tmp_path))
    monkeypatch.setattr(checkpoints_lib.Checkpoints, "save", save)
    assert not os.path.exists(tmp_path / "done")
    again = train_one_run(first, str(tmp_path))
    whole = result["stage1"]
    assert result["schedule"][:3] == [1.0, 1.0, pytest.approx(0.1)]  # changed at step 2
    assert [r["step"] for r in again] == [r["step"] for r in whole]
    for a, b in zip(whole, again):
        assert {k: v for k, v in a.items() if k.endswith(("_acc", "_loss"))} == {
            k: v for k, v in b.items() if k.endswith(("_acc", "_loss"))}
