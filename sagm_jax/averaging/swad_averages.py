"""SWAD's weight averages, kept on the device in the train state.

This module owns the arrays of dense weight averaging (Cha et al., NeurIPS 2021; the
SWAD/SAGM trainers' ``swa_utils.AveragedModel``); ``sagm_jax.averaging.valley`` owns the loss valley
that decides which segments the final model averages, from the evaluation losses alone.

A SEGMENT is the run of steps between two evaluations: segment 0 is step 0 alone,
segment ``k`` the steps after evaluation ``k - 1`` up to evaluation ``k``. Each is
averaged by the running uniform mean of the reference, in float32::

    first step of a segment:   a = w                       (a copy)
    n-th step:                 a <- a + (w - a) / n

inside the jitted train step, after every update (:func:`accumulate`). At evaluation
``k`` the segment's mean moves into slot ``k % W`` of a window of the ``W`` latest
segments (:func:`close_segment`), where the valley's later decisions find it: the final
model is the same running mean over the segments the valley adds (:func:`add_to_final`),
one weight per segment, or a segment alone (:func:`set_final`). Only parameters are
averaged; BatchNorm statistics are not (the reference's averager keeps its own buffers).
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Averages:
    segment: Any  # running mean of the parameters over the current segment
    segment_count: jax.Array  # its steps so far
    window: Any  # the W latest segments' means, stacked: segment k in slot k % W
    final: Any  # running mean over the segments added so far
    final_count: jax.Array  # the segments added (0: ``final`` is a seed or nothing yet)


def init_averages(params, window: int) -> Averages:
    """Empty averages for ``params`` with a window of ``window`` segments. Every leaf is
    its own buffer: the jitted step donates the train state, and a buffer held twice
    would be donated twice."""
    return Averages(
        segment=jax.tree.map(jnp.zeros_like, params),
        segment_count=jnp.zeros([], jnp.int32),
        window=jax.tree.map(lambda p: jnp.zeros((window, *p.shape), p.dtype), params),
        final=jax.tree.map(jnp.zeros_like, params),
        final_count=jnp.zeros([], jnp.int32),
    )


def _running_mean(mean, value, count):
    """``value`` when ``count`` is 0 (a copy), else ``mean + (value - mean) / (count + 1)``."""
    return jax.tree.map(
        lambda m, v: jnp.where(count == 0, v, m + (v - m) / (count + 1).astype(m.dtype)),
        mean,
        value,
    )


def accumulate(averages: Averages, params) -> Averages:
    """The segment's running mean after one more step at ``params`` (jitted with the step)."""
    return averages.replace(
        segment=_running_mean(averages.segment, params, averages.segment_count),
        segment_count=averages.segment_count + 1,
    )


@jax.jit
def close_segment(averages: Averages, slot) -> Averages:
    """The segment ends: its mean goes to window ``slot``, the next segment starts empty."""
    window = jax.tree.map(lambda w, s: w.at[slot].set(s), averages.window, averages.segment)
    return averages.replace(window=window, segment_count=jnp.zeros([], jnp.int32))


@jax.jit
def add_to_final(averages: Averages, slot) -> Averages:
    """The final mean after one more segment, the one in window ``slot``."""
    segment = jax.tree.map(lambda w: w[slot], averages.window)
    return averages.replace(
        final=_running_mean(averages.final, segment, averages.final_count),
        final_count=averages.final_count + 1,
    )


@jax.jit
def set_final(averages: Averages, slot) -> Averages:
    """``final`` = the segment in window ``slot``, with count 0: the reference's seed of
    the final averager (replaced by the first segment added), or its fallback when the
    loss never converged (the last segment alone)."""
    segment = jax.tree.map(lambda w: w[slot], averages.window)
    return averages.replace(final=segment, final_count=jnp.zeros([], jnp.int32))
