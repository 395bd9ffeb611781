"""Sampling, batch layout and placement on a mesh (``sagm_jax.data.pipeline``)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sagm_jax.data as data


def test_train_ids_are_the_sampled_indices_offset_by_environment():
    in_splits = [np.array([0, 2, 4]), np.array([1, 3])]
    ids = data.sample_train_ids(7, 11, in_splits, [100, 10], 5)
    picks = data.sample_train_indices(7, 11, in_splits, 5)
    np.testing.assert_array_equal(ids, np.concatenate([100 + picks[0], 10 + picks[1]]))
    assert set(ids[:5]) <= {100, 102, 104} and set(ids[5:]) <= {11, 13}


def test_a_small_split_is_not_padded_to_the_batch_size():
    assert data.eval_batch_size(5, 128) == 8  # not 128
    assert data.eval_batch_size(5, 128, multiple=8) == 8
    assert data.eval_batch_size(9, 128, multiple=8) == 16
    assert data.eval_batch_size(100, 96, multiple=6) == 96  # large: the configured batch
    assert data.eval_batch_size(40, 96, multiple=6) == 48
    position, mask = data.eval_layout(5, 128, multiple=4)
    assert position.shape == mask.shape == (1, 8) and mask.sum() == 5


def test_eval_hosts_cover_disjoint_columns():
    n, b = 11, 4
    seen = []
    for p in range(2):
        pos, mask = data.eval_layout(n, b, p, 2)
        seen.extend(pos[mask].tolist())
    assert sorted(seen) == list(range(n))


def test_global_batch_on_eight_device_mesh():
    ds = data.load("RotatedDigits", None, trial_seed=0)
    batch = next(
        ds.train_iterator([0, 2, 3, 5], seed=0, batch_per_env=32, process_index=0, process_count=1)
    )
    assert batch["image"].shape == (128, 28, 28, 1)
    picks = data.sample_train_indices(0, 0, [ds.splits[e]["in"] for e in (0, 2, 3, 5)], 32)
    for slot, (e, k) in enumerate(zip((0, 2, 3, 5), picks)):
        np.testing.assert_array_equal(
            batch["image"][32 * slot : 32 * (slot + 1)], ds.source.images[e][k]
        )
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    placed = data.to_global_batch(batch, mesh)
    assert placed["image"].shape == (128, 28, 28, 1)
    assert placed["image"].sharding == NamedSharding(mesh, PartitionSpec("batch"))
    shards = placed["image"].addressable_shards
    assert len(shards) == 8 and all(s.data.shape == (16, 28, 28, 1) for s in shards)
    np.testing.assert_array_equal(np.asarray(placed["label"]), batch["label"])


@pytest.mark.parametrize(
    "n,batch,multiple,processes,shapes",
    [
        (409, 128, 1, 1, [(3, 128), (1, 32)]),  # 384 in whole batches, 25 in a batch of 32
        (384, 128, 1, 1, [(3, 128)]),  # no rest, no padding
        (5, 128, 4, 1, [(1, 8)]),  # smaller than a batch: one small batch
        (1000, 512, 8, 2, [(1, 256), (1, 256)]),  # 488 left: 512; per host 256 columns
        (130, 64, 8, 1, [(2, 64), (1, 8)]),
    ],
)
def test_eval_blocks_cover_the_split_once_with_padding_only_in_the_last_batch(
    n, batch, multiple, processes, shapes
):
    seen = []
    for p in range(processes):
        blocks = data.eval_blocks(n, batch, p, processes, multiple)
        assert [position.shape for position, _ in blocks] == shapes
        for position, mask in blocks:
            assert position.shape == mask.shape and not (~mask[:-1]).any()  # whole rows
            seen.extend(position[mask].tolist())
            assert (position[~mask] == 0).all()
    assert sorted(seen) == list(range(n))
    # Padding: below the last batch's size, at most the rounding to multiple * 2**k.
    rows = sum(
        position.size
        for p in range(processes)
        for position, _ in data.eval_blocks(n, batch, p, processes, multiple)
    )
    assert rows - n < shapes[-1][1] * processes
