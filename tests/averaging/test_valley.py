"""SWAD's loss valley (sagm_jax.averaging.valley) against a re-statement of the reference procedure.

The re-statement below follows SWAD's ``LossValley`` (``khanrc/swad``,
``domainbed/swad.py``) line by line, with deques of "models" (a segment's weights as one
float, its end step and its loss) and an averager that counts its additions as the
reference's ``AveragedModel`` does (a count-0 seed the first addition overwrites).
``select_segments`` is checked against it through the mean of the values at the indices it
returns, and through the order of the added models.
"""

from __future__ import annotations

import doctest
import json
import math
from collections import deque

import numpy as np
import pytest

from sagm_jax.averaging import valley as swad
from sagm_jax.averaging.valley import QUIRK_FIXES, LossValley, segment_window, select_segments

EVAL_EVERY = 100  # segment k ends at step k * EVAL_EVERY


class Model:
    def __init__(self, value: float, end_step: int, loss: float):
        self.value, self.end_step, self.loss = value, end_step, loss


class Averager:
    """A running uniform mean seeded by a model with count 0."""

    def __init__(self, seed: Model):
        self.value, self.count, self.added = seed.value, 0, []

    def add(self, model: Model):
        self.count += 1
        if self.count == 1:
            self.value = model.value
        else:
            self.value = self.value + (model.value - self.value) / self.count
        self.added.append(model)


class ReferenceValley:
    def __init__(self, n_converge=3, n_tolerance=6, tolerance_ratio=0.3):
        self.n_converge, self.n_tolerance, self.ratio = n_converge, n_tolerance, tolerance_ratio
        self.converge_q = deque(maxlen=n_converge)
        self.smooth_q = deque(maxlen=n_tolerance)
        self.final, self.converge_step, self.threshold, self.dead = None, None, None, False

    def update(self, model: Model):
        if self.dead:
            return
        self.converge_q.append(model)
        self.smooth_q.append(model)
        if self.converge_step is None:
            if len(self.converge_q) < self.n_converge:
                return
            if np.argmin([m.loss for m in self.converge_q]) == 0:
                until_min = self.converge_q[0]
                self.converge_step = until_min.end_step
                self.final = Averager(until_min)
                self.threshold = np.mean([m.loss for m in self.converge_q]) * (1 + self.ratio)
                q = list(self.smooth_q)[: self.n_tolerance - self.n_converge + 1]
                start = 0
                for i in reversed(range(len(q))):
                    if q[i].loss > self.threshold:
                        start = i + 1
                        break
                for m in q[start + 1 :]:
                    self.final.add(m)
            return
        if self.smooth_q[0].end_step < self.converge_step:
            return
        if min(m.loss for m in self.smooth_q) > self.threshold:
            self.dead = True
            return
        self.final.add(self.smooth_q[0])

    def final_model(self) -> tuple[float, list[Model]]:
        """(the final weights, the models added to reach them)."""
        if self.converge_step is None:
            return self.converge_q[-1].value, []
        if not self.dead:
            self.smooth_q.popleft()
            while self.smooth_q and min(m.loss for m in self.smooth_q) <= self.threshold:
                self.final.add(self.smooth_q.popleft())
        return self.final.value, self.final.added


def weights(n: int) -> list[float]:
    """Distinct segment 'weights', so a wrong index changes the mean."""
    return [10 * math.sin(1.7 * k + 0.3) for k in range(n)]


def run_reference(losses, **options):
    """(final weights, added weights in order, index at which the valley died)."""
    valley, values, dead_at = ReferenceValley(**options), weights(len(losses)), None
    for k, loss in enumerate(losses):
        valley.update(Model(values[k], k * EVAL_EVERY, loss))
        if valley.dead and dead_at is None:
            dead_at = k
    value, added = valley.final_model()
    return value, [m.value for m in added], dead_at


def run_caller(losses, window, **options):
    """The final weights as a trainer gets them from the Steps, holding only the
    ``window`` latest segments (KeyError if a Step names an older one)."""
    valley, values, held = LossValley(**options), weights(len(losses)), {}
    final, count = None, 0

    def add(index):
        nonlocal final, count
        count += 1
        final = held[index] if count == 1 else final + (held[index] - final) / count

    for k, loss in enumerate(losses):
        held[k] = values[k]
        held.pop(k - window, None)
        step = valley.update(loss)
        if step.seed is not None:
            final, count = held[step.seed], 0
        for index in step.add:
            add(index)
    ending = valley.finish()
    if ending.fallback is not None:
        final = held[ending.fallback]
    for index in ending.add:
        add(index)
    return final


def check_against_reference(losses, **options):
    """select_segments and the Step API agree with the re-statement; returns its answer."""
    reference_value, reference_added, reference_dead_at = run_reference(losses, **options)
    segments, dead_at = select_segments(losses, **options)
    values = weights(len(losses))
    assert dead_at == reference_dead_at
    if reference_added:
        assert [values[i] for i in segments] == reference_added
    else:  # the seed alone, or the last segment when the loss never converged
        assert len(segments) == 1 and values[segments[0]] == reference_value
    assert np.mean([values[i] for i in segments]) == pytest.approx(reference_value, abs=1e-12)
    window = segment_window(options.get("n_tolerance", 6), options.get("n_converge", 3))
    assert run_caller(losses, window, **options) == reference_value
    return segments, dead_at


# Loss sequences that hit each quirk (defaults N_c 3, N_t 6, r 0.3), with the lists
# derived by hand from ``LossValley``'s procedure.
VALLEY = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.55, 0.6, 0.58, 0.59, 0.6, 0.62]
# converges at update 7 with c = 5, tau = 0.715, Q = [2, 3, 4, 5], start = 1:
# seed 5, adds 4, 5 (3 = Q[start] skipped); 5 again at update 10, 6 at 11; finish 7..11.
EARLY = [0.5, 0.6, 0.7, 0.6, 0.55, 0.6, 0.65, 0.6]
# converges at update 2 with c = 0 (SQ not full), tau = 0.78, Q = [0, 1, 2]: adds 1, 2;
# SQ[0] = 0 at updates 3, 4, 5 (0 three times), then 1 and 2 again; finish 3..7.
DEAD = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.55, 0.6, 1, 1, 1, 1, 1, 1, 0.1]
# as VALLEY up to update 7; adds 5, 6, 7 at updates 10-12; six losses of 1 > 0.715 at 13.
LATE = [1.0, 1.0, 0.9, 0.5, 0.55, 0.6]
# converges at the last update, c = 3, Q = [0, 1, 2, 3], start = 3: nothing added at
# convergence; finish drops 0 and adds 1 and 2 (losses above tau, before convergence).
FALLING = [1.0, 0.9, 0.8, 0.7]  # never converges: the last segment alone
SEED_ALONE = [0.1, 1.0, 1.0]  # c = 0, tau = 0.91: nothing is ever added, the seed stays

QUIRK_CASES = {
    "valley": (VALLEY, [4, 5, 5, 6, 7, 8, 9, 10, 11], None),
    "early": (EARLY, [1, 2, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7], None),
    "dead": (DEAD, [4, 5, 5, 6, 7], 13),
    "late": (LATE, [1, 2, 3, 4, 5], None),
    "falling": (FALLING, [3], None),
    "seed alone": (SEED_ALONE, [0], None),
}


@pytest.mark.parametrize("name", QUIRK_CASES)
def test_quirk_sequences_match_the_reference(name):
    losses, expected, expected_dead_at = QUIRK_CASES[name]
    assert check_against_reference(losses) == (expected, expected_dead_at)


def test_each_quirk_is_hit():
    valley, _ = select_segments(VALLEY)
    assert 3 not in valley and 4 in valley  # skipped: Q[start] = 3, Q[start + 1] = 4
    assert valley.count(5) == 2  # the until-min segment counted twice
    early, _ = select_segments(EARLY)
    assert early.count(0) == 3 and early.count(1) == early.count(2) == 2
    late, _ = select_segments(LATE)
    assert 1 in late and LATE[1] > 1.3 * np.mean(LATE[3:6])  # finish ignores convergence
    assert select_segments(DEAD)[1] == 13  # a dead valley
    assert select_segments(DEAD[:14] + [0.1] * 5) == select_segments(DEAD)  # it stays dead
    assert select_segments(FALLING) == ([3], None)


def random_losses(seed: int) -> tuple[list[float], dict]:
    """A noisy falling curve, sometimes rising at the end, sometimes on a coarse grid
    (ties), with the defaults or other windows and ratios."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    k = np.arange(n)
    curve = 2 * np.exp(-k / rng.uniform(1, 10)) + 0.2
    curve = curve * (1 + rng.uniform(-0.3, 0.3, n))
    if rng.random() < 0.4:
        curve += np.maximum(0, k - rng.integers(0, 30)) * rng.uniform(0.05, 0.5)
    if rng.random() < 0.3:
        curve = np.round(curve, 1)
    options = {}
    if seed % 2:
        n_converge = int(rng.integers(1, 5))
        options = dict(
            n_converge=n_converge,
            n_tolerance=int(rng.integers(n_converge, 9)),
            tolerance_ratio=float(rng.choice([0.0, 0.1, 0.3, 0.5])),
        )
    return [float(x) for x in curve], options


def test_random_sequences_match_the_reference():
    seen = {"converged": 0, "dead": 0, "no convergence": 0, "repeats": 0}
    for seed in range(200):
        losses, options = random_losses(seed)
        segments, dead_at = check_against_reference(losses, **options)
        valley = LossValley.from_losses(losses, **options)
        seen["converged"] += valley.converged_at is not None
        seen["dead"] += dead_at is not None
        seen["no convergence"] += valley.converged_at is None
        seen["repeats"] += len(set(segments)) < len(segments)
    assert min(seen.values()) >= 10, seen  # the random sequences reach every case


def test_segment_window_bound_holds_and_is_tight():
    for seed in range(200):
        losses, options = random_losses(seed)
        window = segment_window(options.get("n_tolerance", 6), options.get("n_converge", 3))
        valley, oldest_back = LossValley(**options), 0
        for k, loss in enumerate(losses):
            step = valley.update(loss)
            named = step.add + ([] if step.seed is None else [step.seed])
            oldest_back = max([oldest_back, *(k - i for i in named)])
        ending = valley.finish()
        named = ending.add + ([] if ending.fallback is None else [ending.fallback])
        oldest_back = max([oldest_back, *(len(losses) - 1 - i for i in named)])
        assert oldest_back <= window - 1
    flat = [1.0] * 8  # converges at update 2 with c = 0; adds 0 at update 5
    assert segment_window(6, 3) == 6
    run_caller(flat, 6)
    with pytest.raises(KeyError):
        run_caller(flat, 5)


# fix_quirks: the same sequences, lists derived by hand with the fixes applied.
FIXED_CASES = {
    # Q = [2, 3, 4, 5], start 1: adds 3, 4, 5; 5 not again; 6 at 11; finish 7..11
    "valley": (VALLEY, [3, 4, 5, 6, 7, 8, 9, 10, 11], None),
    # Q ends at c = 0: adds 0; SQ[0] = 0 not again; 1, 2 at updates 6, 7; finish 3..7
    "early": (EARLY, [0, 1, 2, 3, 4, 5, 6, 7], None),
    "dead": (DEAD, [3, 4, 5, 6, 7], 13),
    # Q = [0, 1, 2, 3], start 3: adds 3; finish skips 1, 2 (before c) and 3 (added)
    "late": (LATE, [3, 4, 5], None),
    "falling": (FALLING, [3], None),
    "seed alone": (SEED_ALONE, [0], None),  # Q = [0]: c is added
}


@pytest.mark.parametrize("name", FIXED_CASES)
def test_fixed_quirks_by_hand(name):
    losses, expected, expected_dead_at = FIXED_CASES[name]
    assert select_segments(losses, fix_quirks=True) == (expected, expected_dead_at)
    assert select_segments(losses, fix_quirks=set(QUIRK_FIXES)) == (expected, expected_dead_at)


def test_each_fix_alone_by_hand():
    # add_skipped: 3 and the until-min 5 added at convergence, 5 still again at update 10
    expected = [3, 4, 5, 5, 6, 7, 8, 9, 10, 11]
    assert select_segments(VALLEY, fix_quirks={"add_skipped"})[0] == expected
    # add_once: 5 only once; on EARLY the seed 0 is never added and 1, 2 only once
    assert select_segments(VALLEY, fix_quirks={"add_once"})[0] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert select_segments(EARLY, fix_quirks={"add_once"})[0] == [1, 2, 3, 4, 5, 6, 7]
    # finish_after_convergence: 1 and 2 (before c = 3) are not added at the end
    assert select_segments(LATE, fix_quirks={"finish_after_convergence"})[0] == [3, 4, 5]
    after_convergence = {"finish_after_convergence"}
    assert select_segments(VALLEY, fix_quirks=after_convergence) == select_segments(VALLEY)


def test_fixed_quirks_give_one_contiguous_run_containing_the_until_min_segment():
    for seed in range(200):
        losses, options = random_losses(seed)
        segments, _ = select_segments(losses, fix_quirks=True, **options)
        assert segments == list(range(segments[0], segments[-1] + 1))
        valley = LossValley.from_losses(losses, fix_quirks=True, **options)
        if valley.converged_at is not None:
            assert valley.converged_at in segments
        window = segment_window(options.get("n_tolerance", 6), options.get("n_converge", 3))
        run_caller(losses, window, fix_quirks=True, **options)  # within the window too


def test_replayed_valley_has_the_same_state_and_continues_the_same():
    for seed in range(0, 200, 5):
        losses, options = random_losses(seed)
        options["fix_quirks"] = bool(seed % 10)
        for cut in range(len(losses) + 1):
            running = LossValley(**options)
            for loss in losses[:cut]:
                running.update(loss)
            resumed = LossValley.from_losses(losses[:cut], **options)
            state = running.state_dict()
            assert resumed.state_dict() == state == json.loads(json.dumps(state))
            rest = [(running.update(x), resumed.update(x)) for x in losses[cut:]]
            assert all(a == b for a, b in rest)
            before = running.state_dict()
            assert running.finish() == resumed.finish() == running.finish()
            assert running.state_dict() == before  # finish changes nothing


def test_invalid_inputs_and_nan():
    with pytest.raises(ValueError):
        LossValley(n_converge=4, n_tolerance=3)
    with pytest.raises(ValueError):
        LossValley(tolerance_ratio=-0.1)
    with pytest.raises(ValueError):
        LossValley(fix_quirks={"no_such_fix"})
    with pytest.raises(ValueError):
        LossValley().update(-1.0)
    with pytest.raises(ValueError):
        select_segments([])
    # a diverged evaluation (NaN) counts as above any tolerance, as +inf does
    nan, inf = float("nan"), float("inf")
    assert select_segments(DEAD[:8] + [nan] * 6) == select_segments(DEAD[:8] + [inf] * 6)
    assert select_segments(DEAD[:8] + [nan] * 6)[1] == 13


def test_docstring_examples():
    assert doctest.testmod(swad).failed == 0
