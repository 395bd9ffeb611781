"""Our file order and splits against an independent implementation of DomainBed's rule."""

import hashlib
import json
import os

import numpy as np
import pytest
from data_fixtures import make_tree

import sagm_jax.data as data

EXTS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def reference_splits(root, trial_seed, holdout_fraction):
    """DomainBed's rule written out again, independently of the package."""

    def md5_seed(*args):
        return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)

    out = []
    envs = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    for i, env in enumerate(envs):
        env_dir = os.path.join(root, env)
        files = []
        for cls in sorted(
            c for c in os.listdir(env_dir) if os.path.isdir(os.path.join(env_dir, c))
        ):
            walked = list(os.walk(os.path.join(env_dir, cls), followlinks=True))
            walked.sort()
            for dirpath, _, names in walked:
                for name in sorted(names):
                    if any(name.lower().endswith(e) for e in EXTS):
                        files.append(os.path.join(dirpath, name))
        keys = list(range(len(files)))
        np.random.RandomState(md5_seed(trial_seed, i)).shuffle(keys)
        n_out = int(len(files) * holdout_fraction)
        out.append(([files[k] for k in keys[n_out:]], [files[k] for k in keys[:n_out]]))
    return out


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("splits") / "MyData")
    return root, make_tree(root)


def test_seed_hash_matches_md5_of_tuple_string():
    assert data.seed_hash(0, 1) == int(hashlib.md5(b"(0, 1)").hexdigest(), 16) % 2**31


@pytest.mark.parametrize("trial_seed", [0, 1, 2, 7])
@pytest.mark.parametrize("holdout", [0.2, 0.35])
def test_domainbed_splits_equal_reference(tree, trial_seed, holdout):
    root, _ = tree
    ours = data.domainbed_splits(root, trial_seed, holdout_fraction=holdout)
    assert ours == reference_splits(root, trial_seed, holdout)


def test_listing_rules(tree):
    root, counts = tree
    ours = data.domainbed_splits(root, 0)
    assert [len(i) + len(o) for i, o in ours] == [counts[d] for d in sorted(counts)]
    every = [p for i, o in ours for p in i + o]
    assert not any(p.endswith(".txt") for p in every)
    assert any(p.endswith(".JPG") for p in every) and any(p.endswith(".PNG") for p in every)
    assert any(os.sep + "sub" + os.sep in p for p in every)


def test_load_uses_the_same_split_and_writes_record(tree, tmp_path):
    root, counts = tree
    ds = data.load("ImageFolder", root, trial_seed=3, cache_dir=str(tmp_path / "cache"))
    ref = reference_splits(root, 3, 0.2)
    assert ds.env_names == sorted(counts)
    assert ds.class_names == ["Zebra", "cat", "dog"]
    for e, (ref_in, ref_out) in enumerate(ref):
        paths = ds.folder.paths[e]
        assert [paths[k] for k in ds.splits[e]["in"]] == ref_in
        assert [paths[k] for k in ds.splits[e]["out"]] == ref_out
    # Labels are the sorted class folder of each file (nested files count as their class).
    for env_paths, labels in zip(ds.folder.paths, ds.folder.labels):
        for p, y in zip(env_paths, labels):
            assert os.path.relpath(p, root).split(os.sep)[1] == ds.class_names[y]

    path = ds.write_split(str(tmp_path / "work"))
    record = json.load(open(path))
    assert record["trial_seed"] == 3
    rel0 = record["environments"][0]["files"]["out"]
    assert [os.path.join(root, r) for r in rel0] == ref[0][1]
    relative = sorted(os.path.relpath(p, root) for i, o in ref for p in i + o)
    fp = record["fingerprint"]
    assert fp["files_sha256"] == hashlib.sha256("\n".join(relative).encode()).hexdigest()
    assert fp["domain_totals"] == counts
    assert fp["counts"]["domain_a"]["dog"] == 3 + 1 + 2  # per_class + domain index + nested


def test_in_domain_split_partitions_with_domainbed_val(tree, tmp_path):
    root, _ = tree
    ds = data.load(
        "ImageFolder", root, trial_seed=1, split="in_domain", cache_dir=str(tmp_path / "c")
    )
    ref = reference_splits(root, 1, 0.2)
    for e, parts in enumerate(ds.splits):
        n = ds.env_sizes[e]
        assert sorted(np.concatenate([parts["in"], parts["out"], parts["test"]])) == list(range(n))
        assert len(parts["out"]) == len(parts["test"]) == int(n * 0.2)
        assert [ds.folder.paths[e][k] for k in parts["out"]] == ref[e][1]


def test_importing_the_package_does_not_start_tensorflow():
    import subprocess
    import sys

    code = "import sys, sagm_jax.data; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
