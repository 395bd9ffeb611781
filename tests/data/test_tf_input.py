"""The tf.data input (``sagm_jax.data.tf_input``): its decoding gives torchvision's
loader's pixels, 16-bit PNGs included; and TensorFlow is kept off accelerators
(``hide_accelerators_from_tensorflow``), an error, not a silent fallback, when that is no
longer possible.

The machine running the tests has no GPU for TensorFlow (``tensorflow-cpu``), so the
"too late" path is made as TensorFlow makes it on a GPU machine: a GPU among the
physical and visible devices, and ``tf.config.set_visible_devices`` raising the
RuntimeError TensorFlow raises once its devices are initialised.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from data_fixtures import SIXTEEN_BIT_FILES, pil_rgb, write_sixteen_bit_tree
from PIL import Image

tf = pytest.importorskip("tensorflow")
from sagm_jax.data import image_folder, tf_input  # noqa: E402

TF_ERROR = "Visible devices cannot be modified after being initialized"  # TensorFlow's words
GPU = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")


def fake_gpu(monkeypatch, *, visible: bool):
    """A machine whose TensorFlow has initialised its devices with one GPU, visible
    (``visible``) or already hidden."""
    calls = []

    def set_visible_devices(devices, device_type=None):
        calls.append((list(devices), device_type))
        raise RuntimeError(TF_ERROR)

    monkeypatch.setattr(
        tf.config,
        "list_physical_devices",
        lambda kind=None: [GPU] if kind in (None, "GPU") else [],
    )
    monkeypatch.setattr(
        tf.config,
        "get_visible_devices",
        lambda kind=None: [GPU] if visible and kind in (None, "GPU") else [],
    )
    monkeypatch.setattr(tf.config, "set_visible_devices", set_visible_devices)
    return calls


def test_too_late_with_a_gpu_visible_raises_and_says_what_to_do(monkeypatch):
    calls = fake_gpu(monkeypatch, visible=True)
    with pytest.raises(RuntimeError) as info:
        tf_input.hide_accelerators_from_tensorflow()
    assert calls == [([], "GPU")]  # it did try to hide the GPU
    message = str(info.value)
    assert "TensorFlow already initialised its devices with GPUs visible" in message
    assert "/physical_device:GPU:0" in message and "memory" in message
    assert "call sagm_jax.data.tf_input.hide_accelerators_from_tensorflow()" in message
    assert "before any TensorFlow op" in message
    assert TF_ERROR in message  # TensorFlow's own words kept, and chained
    assert isinstance(info.value.__cause__, RuntimeError)


def test_too_late_but_already_hidden_is_fine(monkeypatch):
    calls = fake_gpu(monkeypatch, visible=False)
    tf_input.hide_accelerators_from_tensorflow()
    assert calls == [([], "GPU")]


def test_no_accelerator_nothing_raises_and_none_is_visible():
    """The real TensorFlow here (no GPU, no TPU), called again after TensorFlow ran ops
    (it did on import of tf_input's users and in other tests): nothing raises."""
    tf.constant(1.0) + 1.0  # devices initialised
    tf_input.hide_accelerators_from_tensorflow()
    tf_input.hide_accelerators_from_tensorflow()
    assert tf.config.get_visible_devices("GPU") == []
    assert tf.config.get_visible_devices("TPU") == []


def test_a_fresh_process_hides_accelerators_on_import():
    """In a fresh process, importing tf_input leaves TensorFlow with no GPU or TPU
    visible and its devices still configurable, and a real too-late call to
    set_visible_devices raises the error the fakes above raise."""
    code = textwrap.dedent(
        f"""
        import tensorflow as tf
        from sagm_jax.data import tf_input
        assert tf.config.get_visible_devices("GPU") == []
        assert tf.config.get_visible_devices("TPU") == []
        tf.constant(1.0) + 1.0
        tf_input.hide_accelerators_from_tensorflow()  # after initialisation: harmless
        try:
            tf.config.set_visible_devices([], "CPU")
        except RuntimeError as error:
            assert str(error) == {TF_ERROR!r}, error
        else:
            raise AssertionError("TensorFlow let visible devices change after initialising")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture(scope="module")
def sixteen_bit_index(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sixteen_bit"))
    write_sixteen_bit_tree(root)
    return image_folder.scan_image_folder(root, missing_help="", cache_dir=None)


def test_the_sixteen_bit_files_are_what_the_tests_need(sixteen_bit_index):
    paths = [p for env in sixteen_bit_index.paths for p in env]
    assert len(paths) == 2 * len(SIXTEEN_BIT_FILES)
    for path in paths:
        name = os.path.basename(path)[: -len(".png")]
        with Image.open(path) as image:
            if name.startswith("gray16"):
                # PIL's 16-bit grayscale mode, with values above 255: clipping and
                # scaling to 8 bits give different pixels.
                assert image.mode in ("I;16", "I;16B", "I"), image.mode
                values = np.asarray(image)
                assert values.max() > 255 and (values <= 255).any()
                assert (pil_rgb(path)[..., 0] == np.minimum(values, 255)).all()
            elif name in ("rgb16", "rgba16", "gray_alpha16"):
                assert image.mode in ("RGB", "RGBA", "LA"), image.mode


@pytest.mark.parametrize("checked", [True, False], ids=["needs_pil", "tf_only"])
def test_tf_decode_pixels_are_pils(sixteen_bit_index, checked):
    """16-bit PNGs through tf.data (graph mode, as the pipeline runs it); ``tf_only``:
    every file decoded by TensorFlow itself, as when the decode check is off."""
    index = sixteen_bit_index
    paths = [p for env in index.paths for p in env]
    needs_pil = np.concatenate(index.needs_pil) if checked else np.zeros(len(paths), bool)
    ds = tf.data.Dataset.from_tensor_slices((paths, needs_pil)).map(tf_input.decode)
    for path, image in zip(paths, ds.as_numpy_iterator()):
        np.testing.assert_array_equal(image, pil_rgb(path), err_msg=path)
