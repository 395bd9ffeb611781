"""sagm_jax.averaging.swad_averages: SWAD's running means on the device against NumPy means."""

import jax
import jax.numpy as jnp
import numpy as np

from sagm_jax.averaging import swad_averages as averaging


def test_segments_and_the_final_mean_are_plain_means_of_what_they_took():
    rng = np.random.default_rng(0)
    steps = [{"w": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=2).astype(np.float32)}
             for _ in range(9)]
    averages = averaging.init_averages(jax.tree.map(jnp.asarray, steps[0]), window=3)
    accumulate = jax.jit(averaging.accumulate)
    # Segments {0}, {1, 2, 3}, {4, 5}, {6, 7, 8} into slots 0, 1, 2, 0 (window 3).
    bounds = [(0, 0), (1, 3), (4, 5), (6, 8)]
    for k, (a, b) in enumerate(bounds):
        for t in range(a, b + 1):
            averages = accumulate(averages, steps[t])
        averages = averaging.close_segment(averages, k % 3)
        assert int(averages.segment_count) == 0
    mean = lambda ts: jax.tree.map(lambda *p: np.mean(np.stack(p).astype(np.float64), 0), *ts)
    segment = [mean(steps[a : b + 1]) for a, b in bounds]
    for slot, k in ((0, 3), (1, 1), (2, 2)):  # slot 0 now holds segment 3
        for leaf, want in zip(jax.tree.leaves(averages.window), jax.tree.leaves(segment[k])):
            np.testing.assert_allclose(np.asarray(leaf)[slot], want, rtol=1e-6)
    # A seed is replaced by the first segment added; then a running mean, repeats counted.
    averages = averaging.set_final(averages, 1)
    assert int(averages.final_count) == 0
    for slot in (2, 0, 0):
        averages = averaging.add_to_final(averages, slot)
    expected = mean([segment[2], segment[3], segment[3]])
    for got, want in zip(jax.tree.leaves(averages.final), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    assert int(averages.final_count) == 3
