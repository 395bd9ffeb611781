"""Reading and checking an image folder (``sagm_jax.data.image_folder``): each kind of bad
input gets its own clear error; skip_bad_files counts the skips; the caches' one root."""

import logging
import os
import shutil

import pytest
from data_fixtures import make_tree, write_image

import sagm_jax.data as data


@pytest.fixture
def tree(tmp_path):
    root = str(tmp_path / "tree")
    make_tree(root, per_class=(2, 2, 2), nested=False)
    return root


def load(root, tmp_path, **kw):
    return data.load("ImageFolder", root, trial_seed=0, cache_dir=str(tmp_path / "cache"), **kw)


def test_missing_dataset_folder_names_it(tmp_path):
    with pytest.raises(data.DatasetNotFoundError, match="office_home"):
        data.load("OfficeHome", str(tmp_path), trial_seed=0)


def test_domains_with_different_classes(tree, tmp_path):
    shutil.rmtree(os.path.join(tree, "domain_c", "cat"))
    with pytest.raises(data.DatasetLayoutError, match="different class folders.*domain_c.*cat"):
        load(tree, tmp_path)


def test_empty_class_folder(tree, tmp_path):
    class_dir = os.path.join(tree, "domain_a", "dog")
    for name in os.listdir(class_dir):
        if not name.endswith(".txt"):
            os.remove(os.path.join(class_dir, name))
    with pytest.raises(data.DatasetLayoutError, match=f"Empty class folder {class_dir}"):
        load(tree, tmp_path)


def _break_files(tree):
    """A truncated JPEG, a zero-byte PNG and a text file named .jpg."""
    truncated = os.path.join(tree, "domain_a", "cat", "truncated.jpg")
    write_image(truncated, (64, 64), 99, "JPEG")
    with open(truncated, "rb") as f:
        head = f.read()
    with open(truncated, "wb") as f:
        f.write(head[: len(head) // 2])
    empty = os.path.join(tree, "domain_b", "dog", "empty.png")
    open(empty, "wb").close()
    text = os.path.join(tree, "domain_c", "Zebra", "text.jpg")
    with open(text, "w") as f:
        f.write("hello, not a JPEG")
    return [truncated, empty, text]


def test_undecodable_files_named(tree, tmp_path):
    bad = _break_files(tree)
    with pytest.raises(data.BadImageError) as err:
        load(tree, tmp_path)
    msg = str(err.value)
    assert "3 file(s)" in msg and "skip_bad_files=True" in msg
    for path in bad:
        assert path in msg


def test_each_bad_file_alone_is_caught(tree, tmp_path):
    for i, path in enumerate(_break_files(tree)):
        others = [p for p in _break_files(tree) if p != path]
        for p in others:
            os.remove(p)
        with pytest.raises(data.BadImageError, match=os.path.basename(path)):
            data.load("ImageFolder", tree, trial_seed=0, cache_dir=str(tmp_path / f"c{i}"))


def test_skip_bad_files_reports_and_drops(tree, tmp_path, caplog):
    good = data.load("ImageFolder", tree, trial_seed=0, cache_dir=None)
    bad = _break_files(tree)
    with caplog.at_level(logging.WARNING):
        ds = load(tree, tmp_path, skip_bad_files=True)
    assert sorted(s["path"] for s in ds.skipped) == sorted(os.path.relpath(p, tree) for p in bad)
    assert ds.fingerprint["skipped"] == ds.skipped
    assert "Skipping 3 file(s)" in caplog.text
    assert ds.env_sizes == good.env_sizes
    assert ds.fingerprint["files_sha256"] == good.fingerprint["files_sha256"]


def test_check_result_cached_but_changed_file_rechecked(tree, tmp_path):
    load(tree, tmp_path)  # fills the cache
    target = os.path.join(tree, "domain_a", "cat", "img_00.jpg")
    with open(target, "wb") as f:
        f.write(b"")  # size and mtime change -> new key
    with pytest.raises(data.BadImageError, match="img_00.jpg"):
        load(tree, tmp_path)


def test_every_cache_lives_under_one_root(tree, tmp_path, monkeypatch):
    """The decode checks and the decoded stores: under $SAGM_JAX_CACHE, or the root given."""
    monkeypatch.setenv("SAGM_JAX_CACHE", str(tmp_path / "env_root"))
    assert data.cache_folder("stores") == str(tmp_path / "env_root" / "stores")
    assert data.cache_folder("verified", str(tmp_path / "given")) == str(
        tmp_path / "given" / "verified"
    )
    ds = data.load("ImageFolder", tree, trial_seed=0)  # the default check cache
    assert len(os.listdir(tmp_path / "env_root" / "verified")) == 1
    data.open_source(ds.folder, image_size=8, mode="cache", workers=1, progress=False)
    assert len(os.listdir(tmp_path / "env_root" / "stores")) == 1
