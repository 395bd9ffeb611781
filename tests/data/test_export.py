"""sagm_jax.data.export: an in-memory dataset written as an RGB image folder that the
image folder's loader reads back, row for row and label for label."""

import os

import numpy as np
import pytest
from PIL import Image

from sagm_jax.data import export, mnist, registry, splits


def test_rotated_digits_exported_as_an_rgb_folder_reads_back_as_its_arrays(tmp_path):
    out = str(tmp_path / "digits")
    assert export.main(["--dataset=RotatedDigits", f"--out={out}"]) == 0
    source = mnist.rotated_digits()
    # Domains and classes sort in the dataset's order, as the image folder lists them.
    assert splits.list_domains(out) == ["0", "15", "30", "45", "60", "75"]
    for env, (name, images, labels) in enumerate(
        zip(source.env_names, source.images, source.labels)
    ):
        classes = sorted(os.listdir(os.path.join(out, name)))
        assert classes == [str(c) for c in range(10)]
        files = sum(len(os.listdir(os.path.join(out, name, c))) for c in classes)
        assert files == len(labels)
        for row in (0, len(labels) - 1):  # grey to RGB: each channel round(255 x)
            path = os.path.join(out, name, str(labels[row]), f"{row:05d}.png")
            rgb = np.asarray(Image.open(path))
            assert rgb.shape == (28, 28, 3)
            expected = np.round(images[row, :, :, 0].astype(np.float64) * 255)
            for channel in range(3):
                np.testing.assert_array_equal(rgb[..., channel], expected)
    # The image folder's loader opens it: six environments, 1,797 images, ten classes.
    data = registry.load("ImageFolder", out, trial_seed=0, cache_dir=None, open_images=None)
    assert data.fingerprint["total"] == 1797
    assert list(data.fingerprint["domain_totals"]) == ["0", "15", "30", "45", "60", "75"]
    assert len(data.class_names) == 10


def test_two_channel_images_put_red_and_green_and_names_keep_their_order():
    x = np.zeros((1, 2, 2, 2), np.float32)
    x[0, 0, 0] = (1.0, 0.5)
    rgb = export.to_rgb(x)
    assert rgb[0, 0, 0].tolist() == [255, 128, 0] and rgb[0, 1, 1].tolist() == [0, 0, 0]
    names = list(mnist.COLOR_ENV_NAMES)  # +90%, +80%, -90%: not in sorted order
    folders = export.domain_folders(names)
    assert folders == ["0_+90%", "1_+80%", "2_-90%"] and sorted(folders) == folders
    assert export.domain_folders(["a/b", "c"]) == ["0_a_b", "1_c"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dataset=PACS"], "--dataset=PACS is an image folder already"),
        (["--dataset=RotatedDigits"], "is not empty; choose a new folder"),
        (["--dataset=Digits"], "Unknown dataset 'Digits'"),
    ],
)
def test_refusals_are_one_message_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file").write_text("")
    assert export.main([*args, f"--out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
