"""TensorFlow is kept off accelerators (``tf_input.hide_accelerators_from_tensorflow``),
and it is an error, not a silent fallback, when that is no longer possible.

The machine running the tests has no GPU for TensorFlow (``tensorflow-cpu``), so the
"too late" path is made as TensorFlow makes it on a GPU machine: a GPU among the
physical and visible devices, and ``tf.config.set_visible_devices`` raising the
RuntimeError TensorFlow raises once its devices are initialised.
"""

import subprocess
import sys
import textwrap

import pytest

tf = pytest.importorskip("tensorflow")
from sagm_jax.data import tf_input  # noqa: E402

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
