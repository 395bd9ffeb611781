"""The opened dataset (``sagm_jax.data.dataset``): training and evaluation batches of an
image folder and of the in-memory arrays, and the ``Source`` interface they come through."""

import functools
import itertools

import numpy as np
import pytest
from data_fixtures import make_tree

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


def smallest_batch_holding(n, batch_size, multiple):
    """The evaluation batch rule written as a search: the allowed sizes are
    ``multiple * 2**k`` up to the step (the largest of them at most batch_size / 8) and
    the step's multiples up to batch_size; the smallest one that holds ``n``."""
    powers = [multiple * 2**k for k in range(20) if multiple * 2**k <= batch_size]
    step = max([p for p in powers if p <= batch_size // 8] or [multiple])
    allowed = [p for p in powers if p <= step] + list(range(step, batch_size + 1, step))
    return min([a for a in allowed if a >= n] or [batch_size])


@pytest.mark.parametrize("part,batch_size", [("in", 5), ("out", 3), ("in", 64)])
def test_eval_visits_every_example_once(folder_data, part, batch_size):
    ds = folder_data
    for env in range(len(ds.env_names)):
        indices = ds.splits[env][part]
        batches = list(
            ds.eval_iterator(env, part, batch_size=batch_size, process_index=0, process_count=1)
        )
        size = data.eval_batch_size(len(indices), batch_size)  # a small split: smaller
        whole, rest = divmod(len(indices), size)
        # Whole batches of ``size``, then the rest in the smallest allowed size holding it.
        expected = [size] * whole + ([smallest_batch_holding(rest, batch_size, 1)] if rest else [])
        assert [b["image"].shape[0] for b in batches] == expected
        assert all(b["mask"].all() for b in batches[:whole])
        labels = np.concatenate([b["label"][b["mask"]] for b in batches])
        assert int(sum(b["mask"].sum() for b in batches)) == len(indices)
        np.testing.assert_array_equal(labels, ds.folder.labels[env][indices])


def test_eval_images_are_the_squashed_files(folder_data):
    from PIL import Image

    ds = folder_data
    batch = next(ds.eval_iterator(1, "out", batch_size=2, process_index=0, process_count=1))
    path = ds.folder.paths[1][ds.splits[1]["out"][0]]
    pil = np.asarray(Image.open(path).convert("RGB").resize((32, 32), Image.BILINEAR)) / 255.0
    ours = batch["image"][0] * np.array([0.229, 0.224, 0.225]) + np.array([0.485, 0.456, 0.406])
    assert np.abs(ours - pil).mean() < 0.03  # PIL vs TF antialiased bilinear


class IdsSource:
    """A source whose batches are the flat ids it is asked for: what a new source sees."""

    def __init__(self, index, image_size):
        self.labels = np.concatenate(index.labels)

    def train_batches(self, ids_at, positions, *, start_step, seed):
        for step in itertools.count(start_step):
            ids = ids_at(step)
            yield {"image": ids, "label": self.labels[ids], "position": positions, "step": step}

    def eval_batches(self, ids, mask, position, *, augment, seed):
        for row_ids, row_mask in zip(ids, mask):
            yield {"image": row_ids, "label": self.labels[row_ids], "mask": row_mask}


def test_a_new_source_gets_flat_ids_of_the_sampled_rows(folder_data, tmp_path):
    ds = data.load(
        "ImageFolder",
        folder_data.folder.root,
        trial_seed=0,
        cache_dir=str(tmp_path),
        open_images=IdsSource,
    )
    offsets = np.cumsum([0] + ds.env_sizes)
    in_splits = [ds.splits[e]["in"] for e in (2, 0)]
    batches = ds.train_iterator(
        [2, 0], seed=3, batch_per_env=4, start_step=5, process_index=1, process_count=2
    )
    for step in (5, 6):
        batch = next(batches)
        picks = data.sample_train_indices(3, step, in_splits, 4)
        flat = np.concatenate([offsets[2] + picks[0], offsets[0] + picks[1]])
        np.testing.assert_array_equal(batch["image"], flat[4:])  # host 1 of 2: rows 4..7
        np.testing.assert_array_equal(batch["position"], np.arange(4, 8))
        assert batch["step"] == step
    for env in range(3):
        batches = ds.eval_iterator(env, "out", batch_size=4, process_index=0, process_count=1)
        seen = np.concatenate([b["image"][b["mask"]] for b in batches])
        np.testing.assert_array_equal(seen, offsets[env] + ds.splits[env]["out"])


def test_every_source_yields_the_same_examples(folder_data, tmp_path):
    """tf.data, the decoded store and the streaming source: same labels, masks and rows."""
    root, canvas = folder_data.folder.root, {}
    for mode in ("cache", "stream"):
        opener = functools.partial(
            data.CanvasSource.open, mode=mode, cache_dir=str(tmp_path), workers=1, progress=False
        )
        canvas[mode] = data.load(
            "ImageFolder", root, trial_seed=0, image_size=32, cache_dir=None, open_images=opener
        )
    for ds in canvas.values():
        for env, part in itertools.product(range(3), ("in", "out")):
            ours, theirs = (
                list(d.eval_iterator(env, part, batch_size=4, process_index=0, process_count=1))
                for d in (ds, folder_data)
            )
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs):
                np.testing.assert_array_equal(a["label"], b["label"])
                np.testing.assert_array_equal(a["mask"], b["mask"])
                assert a["image"].shape == (len(b["label"]), 32, 32, 3)
                assert a["image"].dtype == np.uint8
        ours, theirs = (
            d.train_iterator([0, 1], seed=2, batch_per_env=3, process_index=0, process_count=1)
            for d in (ds, folder_data)
        )
        for a, b in itertools.islice(zip(ours, theirs), 3):
            np.testing.assert_array_equal(a["label"], b["label"])
            np.testing.assert_array_equal(a["position"], np.arange(6))
            assert (a["hw"] <= a["image"].shape[1:3]).all()


def test_array_source_takes_flat_ids_across_environments():
    arrays = data.load("RotatedDigits", None, trial_seed=0).source
    sizes = [len(y) for y in arrays.labels]
    ids = np.array([0, sizes[0] + 7, 3, sum(sizes) - 1, sizes[0]])
    images, labels = arrays.take(ids)
    expected = [(0, 0), (1, 7), (0, 3), (5, sizes[5] - 1), (1, 0)]
    for row, (env, k) in enumerate(expected):
        np.testing.assert_array_equal(images[row], arrays.images[env][k])
        assert labels[row] == arrays.labels[env][k] and labels.dtype == np.int32


def test_a_dataset_opened_for_its_split_has_no_batches(folder_data):
    root = folder_data.folder.root
    ds = data.load("ImageFolder", root, trial_seed=0, cache_dir=None, open_images=None)
    assert ds.source is None and ds.env_sizes == folder_data.env_sizes
    for split, theirs in zip(ds.splits, folder_data.splits):
        np.testing.assert_array_equal(split["out"], theirs["out"])
    with pytest.raises(ValueError, match="split alone"):
        ds.train_iterator([0], seed=0)
    with pytest.raises(ValueError, match="split alone"):
        ds.eval_iterator(0)
