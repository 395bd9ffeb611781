"""The dataset registry (``sagm_jax.data.registry``): names, published layouts and the
help a missing or different download gets."""

import os
import shutil

import pytest
from data_fixtures import make_tree

import sagm_jax.data as data


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError, match="RotatedDigits"):
        data.load("NoSuchSet", "/tmp", trial_seed=0)


def test_missing_data_dir_explains_layout_and_download(tmp_path):
    with pytest.raises(data.DatasetNotFoundError) as err:
        data.load("PACS", str(tmp_path / "nowhere"), trial_seed=0)
    msg = str(err.value)
    assert "PACS/<domain>/<class>/<image>" in msg and "art_painting" in msg
    assert "domainbed/scripts/download.py" in msg and "9,991" in msg


def test_wrong_domains_for_a_named_dataset(tmp_path):
    tree = str(tmp_path / "tree")
    make_tree(tree, per_class=(2, 2, 2), nested=False)
    os.makedirs(tmp_path / "d")
    shutil.copytree(tree, tmp_path / "d" / "PACS")
    with pytest.raises(data.DatasetLayoutError, match="classes, expected 7"):
        data.load("PACS", str(tmp_path / "d"), trial_seed=0, cache_dir=None)
