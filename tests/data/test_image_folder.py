"""Reading and checking an image folder (``sagm_jax.data.image_folder``): each kind of bad
input gets its own clear error; skip_bad_files counts the skips; the caches' one root."""

import functools
import json
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
    assert "3 file(s)" in msg and "--config.skip_bad_files=True" in msg
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


# ---- symlinks: followed like torchvision's ImageFolder, but each image listed once ----
def scan(root):
    return data.image_folder.scan_image_folder(root, missing_help="", verify_images=False)


def written_files(root):
    """{relative path: class name} of the images the fixture wrote, walked without links."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if not name.endswith(".txt"):
                rel = os.path.relpath(os.path.join(folder, name), root)
                found[rel.replace(os.sep, "/")] = rel.split(os.sep)[1]
    return found


def listed_files(index):
    """{relative path: class name} of what the scan listed (duplicates would collapse, so
    the total is compared too)."""
    listed = {}
    for rels, labels in zip(index.relative_paths(), index.labels):
        listed.update({r: index.class_names[y] for r, y in zip(rels, labels)})
    assert len(listed) == sum(len(env) for env in index.paths)
    return listed


@pytest.mark.parametrize("target", [".", "..", "../.."])
def test_a_symlink_loop_is_named(tree, target):
    """``ln -s . cat/loop`` listed each file 41 times; ``../..`` (the dataset folder) also
    labelled every other class's images as cat."""
    link = os.path.join(tree, "domain_a", "cat", "loop")
    os.symlink(target, link)
    with pytest.raises(data.DatasetLayoutError) as err:
        scan(tree)
    msg = str(err.value)
    assert f"{link} -> {target}" in msg and "loop" in msg and "Remove the link" in msg


def test_a_link_to_another_class_is_named(tree):
    """A folder of dog images linked into cat would label them cat (and list them twice)."""
    os.makedirs(os.path.join(tree, "domain_a", "dog", "more"))
    write_image(os.path.join(tree, "domain_a", "dog", "more", "m.jpg"), (9, 9), 7, "JPEG")
    for target in ("../dog", "../dog/more", "../../domain_b/cat"):
        link = os.path.join(tree, "domain_a", "cat", "linked")
        os.symlink(target, link)
        with pytest.raises(data.DatasetLayoutError) as err:
            scan(tree)
        assert f"{link} -> {target}" in str(err.value), target
        assert "twice" in str(err.value)
        os.remove(link)
    assert len(scan(tree).paths[0]) == 3 + 3 + 3 + 1  # the tree is fine again


def test_a_file_linked_twice_into_one_class_is_named(tree, tmp_path):
    cat = os.path.join(tree, "domain_a", "cat")
    os.symlink("img_00.jpg", os.path.join(cat, "copy.jpg"))  # a link next to its target
    with pytest.raises(data.DatasetLayoutError, match=f"{cat}/copy.jpg -> img_00.jpg"):
        scan(tree)
    os.remove(os.path.join(cat, "copy.jpg"))
    outside = str(tmp_path / "outside.jpg")
    write_image(outside, (9, 9), 3, "JPEG")
    os.symlink(outside, os.path.join(cat, "x1.jpg"))  # two links to one file outside
    os.symlink(outside, os.path.join(cat, "x2.jpg"))
    with pytest.raises(data.DatasetLayoutError, match=f"{cat}/x2.jpg -> {outside}"):
        scan(tree)


def test_links_to_folders_and_files_outside_the_tree_are_followed(tree, tmp_path):
    """A dataset assembled from links: a domain folder, a class folder and a file that live
    elsewhere are listed under their link's path, once, with their class."""
    expected = written_files(tree)
    elsewhere = tmp_path / "elsewhere"
    os.makedirs(elsewhere / "zebras")
    shutil.move(os.path.join(tree, "domain_b"), elsewhere / "domain_b")
    os.symlink(elsewhere / "domain_b", os.path.join(tree, "domain_b"))
    shutil.move(os.path.join(tree, "domain_a", "dog"), elsewhere / "dog")
    os.symlink(elsewhere / "dog", os.path.join(tree, "domain_a", "dog"))
    zebra = os.path.join(tree, "domain_c", "Zebra", "img_00.jpg")
    shutil.move(zebra, elsewhere / "zebras" / "z.jpg")
    os.symlink(elsewhere / "zebras" / "z.jpg", zebra)
    assert listed_files(scan(tree)) == expected


# ---- the decode-check cache: a bad one is rebuilt, a read-only one is read ----
@pytest.mark.parametrize("damage", [lambda text: text[:7], lambda text: "[1, 2]"])
def test_a_corrupt_check_cache_is_rebuilt_with_a_warning(tree, tmp_path, caplog, damage):
    """A truncated ``verified/<key>.json`` was 'Expecting value: line 1 column 8', no file
    named; now it is checked again: the broken file is still found, the cache rewritten."""
    bad = _break_files(tree)[0]
    with pytest.raises(data.BadImageError):
        load(tree, tmp_path)
    (cache_file,) = [str(p) for p in (tmp_path / "cache").iterdir()]
    with open(cache_file) as f:
        text = f.read()
    with open(cache_file, "w") as f:
        f.write(damage(text))
    with caplog.at_level(logging.WARNING), pytest.raises(data.BadImageError, match=bad):
        load(tree, tmp_path)
    assert cache_file in caplog.text and "checked again" in caplog.text
    with open(cache_file) as f:
        assert os.path.relpath(bad, tree) in json.load(f)


def test_a_file_where_the_check_cache_folder_should_be(tree, tmp_path, caplog):
    """The cache cannot be written (a file in the way: refused by the file system even for
    root): the images are checked without caching, with a warning naming the folder."""
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    bad = _break_files(tree)[0]
    with caplog.at_level(logging.WARNING), pytest.raises(data.BadImageError, match=bad):
        load(tree, tmp_path)
    assert str(blocker) in caplog.text and "not cached" in caplog.text
    assert blocker.read_text() == "not a folder"


def test_a_read_only_cache_with_a_store_but_no_checks_is_read(tree, tmp_path, monkeypatch, caplog):
    """A shared read-only cache holding a valid store and no ``verified/`` folder: the run
    reads the store and checks the images without caching. The folder is made read-only by
    chmod; root ignores that, so then os.makedirs also refuses to create anything new in it
    (what a read-only file system does), and existing folders pass as they would."""
    cache = tmp_path / "shared"
    ds = data.load("ImageFolder", tree, trial_seed=0, cache_dir=None)
    built = data.open_source(
        ds.folder, image_size=8, mode="cache", cache_dir=str(cache), workers=1, progress=False
    )
    before = sorted(str(p) for p in cache.rglob("*"))
    for path in [cache, *cache.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    if os.geteuid() == 0:
        makedirs = os.makedirs

        def read_only_makedirs(name, mode=0o777, exist_ok=False):
            if str(name).startswith(str(cache)) and not os.path.isdir(name):
                raise PermissionError(13, "Permission denied", str(name))
            makedirs(name, mode, exist_ok)

        monkeypatch.setattr(os, "makedirs", read_only_makedirs)
    open_store = functools.partial(
        data.CanvasSource.open, mode="cache", cache_dir=str(cache), workers=1, progress=False
    )
    try:
        with caplog.at_level(logging.WARNING):
            again = data.load(
                "ImageFolder",
                tree,
                trial_seed=0,
                image_size=8,
                cache_dir=str(cache / "verified"),
                open_images=open_store,
            )
    finally:
        for path in [cache, *cache.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert again.source.images.path == built.path
    assert sorted(str(p) for p in cache.rglob("*")) == before  # nothing written
    assert str(cache / "verified") in caplog.text and "not cached" in caplog.text


# --- the listing checks a run makes before it starts (no image is decoded) ------------


def test_layout_problems_lists_every_problem_of_a_folder_at_once(tree, tmp_path):
    from sagm_jax.data.image_folder import layout_problems

    assert layout_problems(tree) == []  # make_tree's folder is a valid one
    shutil.rmtree(os.path.join(tree, "domain_c", "cat"))  # a class-set mismatch
    os.makedirs(os.path.join(tree, "domain_d"))  # an empty domain
    write_image(os.path.join(tree, "domain_e", "0.png"), (8, 8), 0, "PNG")  # flat
    for name in os.listdir(os.path.join(tree, "domain_a", "dog")):  # an empty class
        os.remove(os.path.join(tree, "domain_a", "dog", name))
    problems = layout_problems(tree)
    text = "\n".join(problems)
    assert len(problems) == 4, text
    assert f"{os.path.join(tree, 'domain_d')} is empty" in text
    assert f"{os.path.join(tree, 'domain_e')} holds 1 image file(s) but no class" in text
    assert f"Empty class folder {os.path.join(tree, 'domain_a', 'dog')}" in text
    assert "domain_c lacks the class folder(s) ['cat']" in text


def test_layout_problems_compares_a_published_dataset_with_its_classes_and_domains(tmp_path):
    from sagm_jax.data.registry import DATASETS, folder_problems

    pacs = DATASETS["PACS"]
    for domain in ("art_painting", "cartoon", "photo", "sketch"):
        for cls in ("dog", "horse", "person"):
            write_image(str(tmp_path / "PACS" / domain / cls / "0.png"), (8, 8), 0, "PNG")
    problems = folder_problems(pacs, str(tmp_path))
    assert len(problems) == 1 and "has 3 class folders (dog, horse, person), expected 7" in (
        problems[0]
    ), problems
    os.rename(tmp_path / "PACS" / "sketch", tmp_path / "PACS" / "sketches")
    problems = folder_problems(pacs, str(tmp_path))
    assert any("domains art_painting, cartoon, photo, sketches, expected art_painting, "
               "cartoon, photo, sketch" in p for p in problems), problems
