"""Training and evaluation batches of an image folder, and their placement on a mesh."""

import jax
import numpy as np
import pytest
from data_fixtures import make_tree
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sagm_jax.data as data


@pytest.fixture(scope="module")
def folder_data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pipe") / "tree")
    make_tree(root)
    return data.load(
        "ImageFolder",
        root,
        trial_seed=0,
        image_size=32,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )


def test_train_batch_per_env_in_env_order(folder_data):
    ds = folder_data
    train_envs = [2, 0]
    it = ds.train_iterator(train_envs, seed=5, batch_per_env=4, process_index=0, process_count=1)
    batch = next(it)
    assert batch["image"].shape == (8, 32, 32, 3) and batch["image"].dtype == np.float32
    assert batch["label"].dtype == np.int32
    picks = data.sample_train_indices(5, 0, [ds.splits[e]["in"] for e in train_envs], 4)
    expected = np.concatenate([ds.folder.labels[e][k] for e, k in zip(train_envs, picks)])
    np.testing.assert_array_equal(batch["label"], expected)
    for e, k in zip(train_envs, picks):  # only 'in' examples are drawn
        assert set(k) <= set(ds.splits[e]["in"])


def test_train_batches_resume_and_split_across_hosts(folder_data):
    ds = folder_data
    full = ds.train_iterator([0, 1], seed=1, batch_per_env=4, process_index=0, process_count=1)
    steps = [next(full) for _ in range(3)]
    resumed = next(
        ds.train_iterator(
            [0, 1], seed=1, batch_per_env=4, start_step=2, process_index=0, process_count=1
        )
    )
    np.testing.assert_array_equal(resumed["image"], steps[2]["image"])
    assert not np.array_equal(steps[0]["image"], steps[1]["image"])
    halves = [
        next(ds.train_iterator([0, 1], seed=1, batch_per_env=4, process_index=p, process_count=2))
        for p in (0, 1)
    ]
    np.testing.assert_allclose(
        np.concatenate([h["image"] for h in halves]), steps[0]["image"], atol=1e-5
    )
    with pytest.raises(ValueError, match="divide"):
        ds.train_iterator([0, 1], seed=1, batch_per_env=3, process_index=0, process_count=4)


@pytest.mark.parametrize("part,batch_size", [("in", 5), ("out", 3), ("in", 64)])
def test_eval_visits_every_example_once(folder_data, part, batch_size):
    ds = folder_data
    for env in range(len(ds.env_names)):
        indices = ds.splits[env][part]
        batches = list(
            ds.eval_iterator(env, part, batch_size=batch_size, process_index=0, process_count=1)
        )
        size = data.eval_batch_size(len(indices), batch_size)  # a small split: smaller
        assert size <= batch_size and all(b["image"].shape[0] == size for b in batches)
        labels = np.concatenate([b["label"][b["mask"]] for b in batches])
        assert int(sum(b["mask"].sum() for b in batches)) == len(indices)
        np.testing.assert_array_equal(labels, ds.folder.labels[env][indices])
        assert len(batches) == -(-len(indices) // size)


def test_a_small_split_is_not_padded_to_the_batch_size():
    assert data.eval_batch_size(5, 128) == 8  # not 128
    assert data.eval_batch_size(5, 128, multiple=8) == 8
    assert data.eval_batch_size(9, 128, multiple=8) == 16
    assert data.eval_batch_size(100, 96, multiple=6) == 96  # large: the configured batch
    assert data.eval_batch_size(40, 96, multiple=6) == 48
    position, mask = data.eval_layout(5, 128, multiple=4)
    assert position.shape == mask.shape == (1, 8) and mask.sum() == 5


def test_eval_images_are_the_squashed_files(folder_data):
    from PIL import Image

    ds = folder_data
    batch = next(ds.eval_iterator(1, "out", batch_size=2, process_index=0, process_count=1))
    path = ds.folder.paths[1][ds.splits[1]["out"][0]]
    pil = np.asarray(Image.open(path).convert("RGB").resize((32, 32), Image.BILINEAR)) / 255.0
    ours = batch["image"][0] * np.array([0.229, 0.224, 0.225]) + np.array([0.485, 0.456, 0.406])
    assert np.abs(ours - pil).mean() < 0.03  # PIL vs TF antialiased bilinear


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
            batch["image"][32 * slot : 32 * (slot + 1)], ds.arrays.images[e][k]
        )
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    placed = data.to_global_batch(batch, mesh)
    assert placed["image"].shape == (128, 28, 28, 1)
    assert placed["image"].sharding == NamedSharding(mesh, PartitionSpec("batch"))
    shards = placed["image"].addressable_shards
    assert len(shards) == 8 and all(s.data.shape == (16, 28, 28, 1) for s in shards)
    np.testing.assert_array_equal(np.asarray(placed["label"]), batch["label"])
