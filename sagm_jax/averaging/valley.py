"""SWAD's loss valley: which segment averages the final model averages, from losses alone.

This module owns the DECISIONS of SWAD (Cha et al., NeurIPS 2021), as the SWAD/SAGM
trainers' ``LossValley`` makes them (``khanrc/swad``, ``domainbed/swad.py``; docs/swad.md);
``sagm_jax.averaging.swad_averages`` owns the arrays they act on. It is pure Python on the host and
never sees a weight.

Segments. Evaluation ``k`` closes segment ``k``: segment 0 is step 0 alone, segment ``k``
the steps after evaluation ``k - 1`` up to evaluation ``k``. ``ℓ_k`` is the validation
loss read at evaluation ``k`` (the training environments' mean ``out`` loss). The caller
keeps each segment's mean of the weights; the valley says which of them enter the final
model, a running uniform mean with one weight per segment added.

The procedure, with windows CQ (the ``N_c`` latest segments) and SQ (the ``N_t`` latest)::

    update(k):  if dead: nothing
                push k onto CQ and SQ
                before convergence, once CQ is full and argmin_i ℓ(CQ[i]) = 0 (first on ties):
                    c = CQ[0]                          (the until-min segment; converged)
                    τ = (1 + r) · mean(ℓ over CQ)
                    Q = SQ[: N_t - N_c + 1]            (ends at c only if SQ is full)
                    start = 1 + last i with ℓ(Q[i]) > τ, or 0 if none
                    seed final with c (count 0: the first add overwrites it); add Q[start+1:]
                after convergence:  if SQ[0] < c: nothing
                                    elif min(ℓ over SQ) > τ: dead (training stops)
                                    else add SQ[0]
    finish():   not converged: the final model is the last segment alone
                dead: nothing more
                else drop SQ[0]; while SQ and min(ℓ over SQ) <= τ: add SQ.popleft()

After convergence segment ``j`` is thus added iff some segment among ``j .. j + N_t - 1``
has loss ``<= τ``; the first window of ``N_t`` losses all above ``τ`` kills the valley.

The reference's quirks, reproduced by default (``fix_quirks=False``):

* SKIPPED: the until-min segment ``c`` only seeds the final model with count 0 (the first
  add overwrites it), and ``Q[start]``, the first segment in the valley, is never added
  at convergence.
* TWICE: with SQ full at convergence, ``Q`` ends at ``c``; ``c`` is added there and again
  when it becomes SQ[0], ``N_t - 1`` evaluations later.
* EARLY CONVERGENCE: before SQ is full (convergence at evaluation ``k < N_t - 1``) ``Q``
  reaches past ``c``, and SQ[0] stays segment 0 while SQ fills, so early segments are
  added several times (segment 0 up to ``N_t - N_c`` times when ``c = 0``).
* FINISH IGNORES CONVERGENCE: ``finish`` adds every segment of SQ after the first while
  the window's minimum is ``<= τ``, so segments before ``c``, even ones the start rule
  left out, enter the final model when the run ends soon after converging.
* DEAD VALLEY ENDS TRAINING: the reference stops training at ``Step.dead``; that is the
  caller's choice (``config.swad_stop_at_valley_end``), updates after it change nothing.

``fix_quirks=True`` (or a collection of the names below) applies one fix per quirk:

* ``"add_skipped"``: ``Q`` ends at ``c`` (``Q = SQ[: len(SQ) - N_c + 1]``) and all of
  ``Q[start:]`` is added, with no count-0 seed: the until-min segment and the first
  segment of the valley are added, not skipped (``ℓ_c <= τ`` for losses >= 0 and r >= 0,
  so ``c`` is always among them).
* ``"add_once"``: a segment is added only if it comes after the last one added, so none
  is added twice (this covers early convergence too).
* ``"finish_after_convergence"``: ``finish`` adds only segments at or after ``c``.

With all three, the final model is the mean of one contiguous run of segments, each once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

QUIRK_FIXES = {
    "add_skipped": "the until-min segment and Q[start] are added; no count-0 seed",
    "add_once": "no segment is added twice",
    "finish_after_convergence": "finish adds only segments at or after convergence",
}


class Step(NamedTuple):
    """What the caller does with its segment averages after one ``LossValley.update``,
    in this order: ``seed`` (a segment index, or None): the final model becomes that
    segment with count 0, so the first add replaces it; ``add``: segment indices added to
    the final running mean, in order, repeats included; ``dead``: the valley ended at this
    update (the reference stops training)."""

    seed: int | None
    add: list[int]
    dead: bool


class Finish(NamedTuple):
    """What the caller does at the end of training (``LossValley.finish``): ``add`` these
    segments to the final running mean, in order; or, when ``fallback`` is not None (the
    loss never converged), the final model is that segment (the last one) alone."""

    add: list[int]
    fallback: int | None


def segment_window(n_tolerance: int, n_converge: int) -> int:
    """How many of the latest segment averages (the one just closed included) the caller
    must hold so that every index a ``Step`` or ``Finish`` names is still held: ``N_t``.

    Proof. At update ``k`` the valley's SQ holds the latest ``min(k + 1, N_t)`` segments
    and CQ the latest ``N_c <= N_t``, so CQ ⊆ SQ. A ``Step`` names the seed ``CQ[0]``,
    segments of ``Q``, a prefix of SQ, or ``SQ[0]``; a ``Finish`` names segments of SQ or
    its fallback ``CQ[-1] = k``. All lie in SQ, hence ``>= k - N_t + 1``. The bound is
    tight: with equal losses the valley converges at update ``N_c - 1`` with ``c = 0``
    and adds ``SQ[0] = 0`` at update ``N_t - 1``, ``N_t - 1`` segments back.
    """
    _check_windows(n_converge, n_tolerance)
    return n_tolerance


def _check_windows(n_converge: int, n_tolerance: int) -> None:
    if n_converge < 1 or n_tolerance < n_converge:
        # The reference's N_t < N_c branch is unused by every published run; not ported.
        raise ValueError(
            f"SWAD needs 1 <= n_converge <= n_tolerance, got n_converge={n_converge}, "
            f"n_tolerance={n_tolerance}."
        )


def _fix_names(fix_quirks: bool | Iterable[str]) -> frozenset[str]:
    if isinstance(fix_quirks, str):
        names = frozenset([fix_quirks])
    elif isinstance(fix_quirks, Iterable):
        names = frozenset(fix_quirks)
    else:  # a boolean (the config's swad_fix_quirks): all fixes or none
        return frozenset(QUIRK_FIXES) if fix_quirks else frozenset()
    unknown = names - set(QUIRK_FIXES)
    if unknown:
        raise ValueError(
            f"Unknown SWAD quirk fixes {sorted(unknown)}; known: {sorted(QUIRK_FIXES)}."
        )
    return names


def _checked_loss(loss: float) -> float:
    loss = float(loss)
    if math.isnan(loss):
        return math.inf  # a diverged evaluation is above any tolerance
    if loss < 0:
        raise ValueError(f"SWAD reads cross-entropy losses, which are >= 0; got {loss}.")
    return loss


class LossValley:
    """SWAD's loss valley (module docstring): call :meth:`update` once per evaluation, in
    order, with its validation loss, then :meth:`finish` once at the end of training."""

    def __init__(
        self,
        n_converge: int = 3,
        n_tolerance: int = 6,
        tolerance_ratio: float = 0.3,
        fix_quirks: bool | Iterable[str] = False,
    ):
        _check_windows(n_converge, n_tolerance)
        if not tolerance_ratio >= 0:
            raise ValueError(f"SWAD's tolerance_ratio must be >= 0, got {tolerance_ratio}.")
        self.n_converge, self.n_tolerance = int(n_converge), int(n_tolerance)
        self.tolerance_ratio = float(tolerance_ratio)
        self.fixes = _fix_names(fix_quirks)
        self.losses: list[float] = []
        self._converge_window: deque[int] = deque(maxlen=self.n_converge)  # CQ
        self._tolerance_window: deque[int] = deque(maxlen=self.n_tolerance)  # SQ
        self.converged_at: int | None = None  # c, the until-min segment
        self.threshold: float | None = None  # τ
        self.dead_at: int | None = None  # the update at which the valley died
        self.seed: int | None = None
        self.last_added = -1

    @classmethod
    def from_losses(cls, losses: Iterable[float], **options) -> "LossValley":
        """The valley after updates with ``losses`` (how a resumed run rebuilds it; its
        final mean, already holding those updates' adds, comes from the checkpoint)."""
        valley = cls(**options)
        for loss in losses:
            valley.update(loss)
        return valley

    @property
    def dead(self) -> bool:
        return self.dead_at is not None

    def update(self, loss: float) -> Step:
        """Reads evaluation ``len(self.losses)``'s validation loss; says what to do now."""
        index = len(self.losses)
        self.losses.append(_checked_loss(loss))
        if self.dead:
            return Step(None, [], False)
        self._converge_window.append(index)
        self._tolerance_window.append(index)
        if self.converged_at is None:
            return self._try_to_converge()
        return self._follow_valley(index)

    def _try_to_converge(self) -> Step:
        window = [self.losses[i] for i in self._converge_window]
        if len(window) < self.n_converge or min(range(len(window)), key=window.__getitem__) != 0:
            return Step(None, [], False)
        until_min = self._converge_window[0]
        self.converged_at = until_min
        self.threshold = sum(window) / len(window) * (1.0 + self.tolerance_ratio)
        held = list(self._tolerance_window)
        if "add_skipped" in self.fixes:
            candidates = held[: held.index(until_min) + 1]
        else:
            candidates = held[: self.n_tolerance - self.n_converge + 1]
        above = [i for i, segment in enumerate(candidates) if self.losses[segment] > self.threshold]
        start = above[-1] + 1 if above else 0
        if "add_skipped" in self.fixes:
            return Step(None, self._admit(candidates[start:]), False)
        self.seed = until_min
        return Step(until_min, self._admit(candidates[start + 1 :]), False)

    def _follow_valley(self, index: int) -> Step:
        oldest = self._tolerance_window[0]
        if oldest < self.converged_at:
            return Step(None, [], False)
        if min(self.losses[i] for i in self._tolerance_window) > self.threshold:
            self.dead_at = index
            return Step(None, [], True)
        return Step(None, self._admit([oldest]), False)

    def _admit(self, segments: list[int]) -> list[int]:
        """``segments`` as added, ``add_once`` applied; records the last one added."""
        added, self.last_added = _added_once(segments, self.last_added, "add_once" in self.fixes)
        return added

    def finish(self) -> Finish:
        """The end of training (the reference's ``get_final_model``). Changes nothing, so
        it may be asked again."""
        if self.converged_at is None:
            if not self.losses:
                raise ValueError("SWAD: no evaluation was made, so there is no segment.")
            return Finish([], fallback=self._converge_window[-1])
        if self.dead:
            return Finish([], None)
        remaining = list(self._tolerance_window)[1:]
        added = []
        while remaining and min(self.losses[i] for i in remaining) <= self.threshold:
            added.append(remaining.pop(0))
        if "finish_after_convergence" in self.fixes:
            added = [segment for segment in added if segment >= self.converged_at]
        added, _ = _added_once(added, self.last_added, "add_once" in self.fixes)
        return Finish(added, None)

    def state_dict(self) -> dict:
        """Everything the valley holds, as plain values (equal for a replayed valley)."""
        return {
            "n_converge": self.n_converge,
            "n_tolerance": self.n_tolerance,
            "tolerance_ratio": self.tolerance_ratio,
            "fix_quirks": sorted(self.fixes),
            "losses": list(self.losses),
            "converge_window": list(self._converge_window),
            "tolerance_window": list(self._tolerance_window),
            "converged_at": self.converged_at,
            "threshold": self.threshold,
            "dead_at": self.dead_at,
            "seed": self.seed,
            "last_added": self.last_added,
        }


def _added_once(segments: list[int], last_added: int, once: bool) -> tuple[list[int], int]:
    if once:
        segments = [s for s in segments if s > last_added]
    return segments, max([last_added, *segments])


def select_segments(
    losses: Iterable[float],
    n_converge: int = 3,
    n_tolerance: int = 6,
    tolerance_ratio: float = 0.3,
    fix_quirks: bool | Iterable[str] = False,
) -> tuple[list[int], int | None]:
    """SWAD's choice over a whole run: ``(segments, dead_at)``.

    ``losses[k]`` is the validation loss of evaluation ``k`` (index 0 = step 0).
    ``segments`` are the indices of the segment averages whose uniform mean is the final
    model, with multiplicity, in the order they are added; the reference's count-0 seed
    is not among them unless it is added too (or nothing is: the final model is then the
    seed alone, ``[c]``); with no convergence, ``[last index]``, the last segment alone.
    ``dead_at`` is the evaluation at which the valley died (the reference stops training
    there; later losses change nothing), or None.

    By default the reference's quirks are kept (module docstring): a skipped segment
    (the until-min seed and ``Q[start]``), the until-min segment counted twice, several
    additions of early segments when convergence comes before the tolerance window
    fills, ``finish`` adding segments from before convergence, and a dead valley ending
    training. ``fix_quirks=True`` (or names from :data:`QUIRK_FIXES`) fixes them.

    >>> losses = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.55, 0.6, 1, 1, 1, 1, 1, 1]
    >>> select_segments(losses)  # converged at 7 (c = 5), segment 3 skipped, 5 twice
    ([4, 5, 5, 6, 7], 13)
    >>> select_segments(losses, fix_quirks=True)
    ([3, 4, 5, 6, 7], 13)
    """
    valley = LossValley(n_converge, n_tolerance, tolerance_ratio, fix_quirks)
    segments, seed = [], None
    for loss in losses:
        step = valley.update(loss)
        seed = step.seed if step.seed is not None else seed
        segments += step.add
    ending = valley.finish()
    if ending.fallback is not None:
        return [ending.fallback], valley.dead_at
    segments += ending.add
    return (segments or [seed]), valley.dead_at
