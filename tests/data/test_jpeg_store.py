"""The compressed image store (``sagm_jax.data.jpeg_store``): pixels against PIL's decode of the
original files, originals kept byte-for-byte, reuse, staleness, corruption, concurrent builds
in two processes, exact resume, and ``open_source``'s choice. Tiny images, short_side 24."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from sagm_jax.data import canvas, decode, image_folder, jpeg_store, store, streaming

SHORT, S = 24, 16  # short_side and image_size of the tests' stores
# (width, height, format): JPEGs within the bounded size (kept as their bytes), larger ones
# (shrunk, re-encoded), PNGs of both kinds, a grayscale, a progressive and a CMYK JPEG.
FILES = (
    (20, 30, "JPEG"),
    (24, 24, "JPEG"),
    (100, 80, "JPEG"),
    (64, 48, "JPEG"),
    (31, 17, "PNG"),
    (24, 90, "PNG"),
    (57, 41, "PNG"),
    (22, 19, "L"),
    (90, 60, "PROGRESSIVE"),
    (23, 26, "CMYK"),
    (150, 47, "JPEG"),
    (13, 21, "JPEG"),
)
# Small files whose original bytes are kept: RGB and grayscale JPEGs within the bounded size
# (libjpeg-turbo in simplejpeg decodes them to PIL's pixels exactly). A CMYK JPEG is
# re-encoded: simplejpeg does not convert CMYK to RGB as PIL does.
KEPT = {0, 1, 7, 11}


def _write(path, width, height, fmt, seed):
    """A smooth texture plus grain (photo-like: JPEG's error depends on the content)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 2, width // 8 + 2, 3), np.uint8)
    smooth = np.asarray(Image.fromarray(base).resize((width, height), Image.BILINEAR))
    image = Image.fromarray(
        np.clip(smooth + rng.integers(-8, 9, smooth.shape), 0, 255).astype(np.uint8)
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if fmt == "PNG":
        image.save(path, format="PNG")
    elif fmt == "L":
        image.convert("L").save(path, format="JPEG", quality=90)
    elif fmt == "CMYK":
        image.convert("CMYK").save(path, format="JPEG", quality=90)
    else:
        image.save(path, format="JPEG", quality=85, progressive=fmt == "PROGRESSIVE")


def make_index(root, domains=("d0", "d1"), files=FILES):
    """root/<domain>/<class>/<k>.<ext>, files dealt round-robin over two classes."""
    seed = 0
    for domain in domains:
        for k, (w, h, fmt) in enumerate(files):
            seed += 1
            ext = ".png" if fmt == "PNG" else ".jpg"
            _write(os.path.join(root, domain, f"c{k % 2}", f"{k}{ext}"), w, h, fmt, seed)
    return image_folder.scan_image_folder(str(root), missing_help="", cache_dir=None)


def open_compressed(index, cache, **kwargs):
    kwargs = {"mode": "compressed", "workers": 1, "progress": False, **kwargs}
    return canvas.open_source(index, image_size=S, short_side=SHORT, cache_dir=str(cache), **kwargs)


def flat(index):
    return [p for env in index.paths for p in env]


def pil_decode(path):
    """torchvision's loader, independently of the store's code."""
    with Image.open(path) as image:
        return image.convert("RGB")


def pil_stored(path):
    image = pil_decode(path)
    w, h = image.size
    if min(w, h) > SHORT:  # shorter side to SHORT, the other rounded, halves up
        w, h = (
            (round(w * SHORT / h + 1e-9), SHORT) if h <= w else (SHORT, round(h * SHORT / w + 1e-9))
        )
        image = image.resize((w, h), Image.BILINEAR)
    return np.asarray(image)


def pil_eval(path):
    return np.asarray(pil_decode(path).resize((S, S), Image.BILINEAR))


def stores_in(cache):
    return sorted(os.listdir(os.path.join(cache, "stores")))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store built by two worker processes, with shards of 2 KB (several per stream)."""
    index = make_index(tmp_path_factory.mktemp("tree"))
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jpeg_store, "SHARD_BYTES", 2048)
        source = open_compressed(index, cache, workers=2)
    yield index, cache, source
    source.close()


def test_pixels_within_the_measured_distance_of_pils(built):
    index, _, source = built
    paths = flat(index)
    assert isinstance(source, jpeg_store.CompressedStore) and len(source) == len(paths)
    assert sum(name.startswith("train-") for name in os.listdir(source.path)) > 2
    ids = np.array([*range(len(paths))][::-1] + [3, 3, 0])
    images, hw = source.gather(ids)
    evals = source.eval_images(ids)
    assert images.dtype == np.uint8 and hw.dtype == np.int32 and evals.dtype == np.uint8
    assert images.shape == (len(ids), *source.canvas, 3) and evals.shape == (len(ids), S, S, 3)
    train_diff, eval_diff = [], []
    for k, i in enumerate(ids):
        want = pil_stored(paths[i])
        h, w = want.shape[:2]
        np.testing.assert_array_equal(hw[k], (h, w))
        assert not images[k, h:].any() and not images[k, :, w:].any()
        diff = np.abs(images[k, :h, :w].astype(int) - want).ravel()
        eval_diff.append(np.abs(evals[k].astype(int) - pil_eval(paths[i])).ravel())
        if source.kept[i]:  # the original's bytes: the reference's pixels exactly
            assert not diff.any(), paths[i]
        else:
            train_diff.append(diff)
    # Measured on these images (grain of +-8 levels on every pixel, JPEG's hardest content,
    # at quality 95, 4:4:4), in grey levels: re-encoded training images mean 2.5, max 19;
    # evaluation images mean 2.4, max 15. (On bench_decode.py's DomainNet-like folder:
    # 0.92 / 22 and 0.88 / 23, docs/data/bench_decode_cpu.txt.)
    train_diff, eval_diff = np.concatenate(train_diff), np.concatenate(eval_diff)
    assert 1 < train_diff.mean() < 3 and train_diff.max() <= 24
    assert 1 < eval_diff.mean() < 3 and eval_diff.max() <= 20
    with pytest.raises(IndexError, match="ids must be in"):
        source.gather([len(paths)])


def test_small_jpegs_are_kept_as_their_original_bytes(built):
    index, _, source = built
    paths = flat(index)
    kept = {i for i in range(len(paths)) if source.kept[i]}
    named = {i for i, p in enumerate(paths) if int(os.path.basename(p).split(".")[0]) in KEPT}
    assert kept == named and len(kept) == 2 * len(KEPT)
    for i in sorted(kept):
        with open(paths[i], "rb") as f:
            assert bytes(source._train.record(i)) == f.read()
        np.testing.assert_array_equal(
            source.gather([i])[0][0, : source.shapes[i][0], : source.shapes[i][1]],
            np.asarray(pil_decode(paths[i])),
        )


def test_same_ids_same_batch_and_a_second_open_decodes_nothing(built, monkeypatch):
    index, cache, first = built
    ids = np.array([5, 1, 17, 5, 0, 22])
    want, want_eval = first.gather(ids)[0], first.eval_images(ids)

    def forbidden(*args, **kwargs):
        raise AssertionError("decoded the original files again")

    for module, name in (
        (jpeg_store, "decode_file"),
        (jpeg_store, "read_sizes"),
        (canvas, "read_sizes"),
    ):
        monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(jpeg_store, "_encode_chunk", forbidden)
    again = open_compressed(index, cache)
    single = jpeg_store.CompressedStore.open(again.path, threads=1)
    assert again.path == first.path and len(stores_in(cache)) == 1
    for source in (again, single, first):
        np.testing.assert_array_equal(source.gather(ids)[0], want)
        np.testing.assert_array_equal(source.eval_images(ids), want_eval)
    again.close()
    single.close()


def test_canvas_source_serves_it(built):
    index, _, source = built
    served = canvas.CanvasSource(source, np.concatenate(index.labels))
    batch = next(
        served.train_batches(lambda step: np.array([step, 2]), np.arange(2), start_step=3, seed=0)
    )
    np.testing.assert_array_equal(batch["image"], source.gather([3, 2])[0])
    np.testing.assert_array_equal(batch["label"], served.labels[[3, 2]])
    (evaluation,) = served.eval_batches(
        np.array([[1, 4]]), np.array([[True, False]]), np.array([[0, 1]]), augment=False, seed=0
    )
    np.testing.assert_array_equal(evaluation["image"], source.eval_images([1, 4]))


def test_changed_files_give_a_new_store(tmp_path, caplog):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:3])
    cache = tmp_path / "cache"
    old = open_compressed(index, cache)
    path = flat(index)[0]
    _write(path, 20, 30, "JPEG", seed=99)  # new pixels (and mtime)
    with caplog.at_level(logging.WARNING, logger="sagm_jax.data"):
        new = open_compressed(index, cache)
    assert new.path != old.path
    assert "changed since the compressed store" in caplog.text and old.path in caplog.text
    np.testing.assert_array_equal(new.gather([0])[0][0, :30, :20], pil_stored(path))
    assert not np.array_equal(old.gather([0])[0], new.gather([0])[0])


def _flip(prefix):
    def flip(path):
        name = min(n for n in os.listdir(path) if n.startswith(prefix))
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    return flip


def _truncate(path):
    with open(os.path.join(path, "train-00000.jpgs"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 5)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_truncate, "truncated"),
        (_flip("train-"), "CRC-32"),
        (_flip("eval-"), "CRC-32"),
        (_flip("train_offsets"), "CRC-32"),
        (lambda path: os.remove(os.path.join(path, store.MANIFEST)), "no manifest"),
    ],
    ids=["truncated-shard", "flipped-train", "flipped-eval", "flipped-offsets", "no-manifest"],
)
def test_corrupt_store_is_rebuilt_not_used(tmp_path, monkeypatch, caplog, damage, reason):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:4])
    cache = tmp_path / "cache"
    first = open_compressed(index, cache)
    want = first.gather(np.arange(4))[0].copy(), first.eval_images(np.arange(4))
    first.close()
    damage(os.path.join(cache, "stores", stores_in(cache)[0]))
    calls = []
    real = jpeg_store._encode_chunk
    monkeypatch.setattr(jpeg_store, "_encode_chunk", lambda job: calls.append(job) or real(job))
    with caplog.at_level(logging.WARNING, logger="sagm_jax.data"):
        again = open_compressed(index, cache)
    assert reason in caplog.text and "Rebuilding" in caplog.text
    assert sum(len(job[1]) for job in calls) == 4 and len(stores_in(cache)) == 1
    np.testing.assert_array_equal(again.gather(np.arange(4))[0], want[0])
    np.testing.assert_array_equal(again.eval_images(np.arange(4)), want[1])


_CONCURRENT_BUILD = """
import logging, os, sys, time
from sagm_jax.data import canvas, image_folder, jpeg_store, store

real = jpeg_store._encode_chunk

def encode_together(job):  # both processes are building before either finishes
    open(os.path.join(sys.argv[3], str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(sys.argv[3])) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return real(job)

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    jpeg_store._encode_chunk = encode_together
    index = image_folder.scan_image_folder(sys.argv[1], missing_help="", cache_dir=None)
    source = canvas.open_source(index, image_size=16, short_side=24, mode="compressed",
                               cache_dir=sys.argv[2], workers=1, progress=False)
    print("PATH", source.path)
"""


def test_two_processes_building_at_once_leave_one_store(tmp_path):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:5])
    script, markers, cache = tmp_path / "build.py", tmp_path / "markers", tmp_path / "cache"
    script.write_text(_CONCURRENT_BUILD)
    markers.mkdir()
    args = [sys.executable, str(script), str(tmp_path / "tree"), str(cache), str(markers)]
    children = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    assert len(os.listdir(markers)) == 2  # both encoded: the builds overlapped
    paths = {
        line.split()[1]
        for out, _ in outputs
        for line in out.splitlines()
        if line.startswith("PATH")
    }
    assert len(paths) == 1 and stores_in(cache) == [os.path.basename(paths.pop())]
    assert sum("Another process built" in err for _, err in outputs) == 1
    source = open_compressed(index, cache)
    jpeg_store.CompressedStore.open(source.path)  # valid: checksums match
    want = [pil_stored(p) for p in flat(index)]
    got, hw = source.gather(np.arange(len(want)))
    for k, image in enumerate(want):
        assert np.abs(got[k, : hw[k][0], : hw[k][1]].astype(int) - image).max() <= 20


def test_auto_picks_the_compressed_store_over_budget(tmp_path, caplog):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:6])
    cache = tmp_path / "cache"
    sizes = decode.read_sizes(flat(index), progress=False)
    decoded = store.estimate_store_bytes(sizes, S, SHORT)
    compressed = jpeg_store.estimate_bytes(sizes, S, SHORT)
    assert compressed == int(jpeg_store.BYTES_PER_PIXEL * decoded / 3) < decoded
    tiny = open_compressed(index, cache, mode="auto", budget_gb=1e-9)  # neither fits
    assert isinstance(tiny, streaming.StreamingSource) and stores_in(cache) == []
    budget_gb = (compressed + decoded) / 2 / 2**30  # the compressed store fits, the decoded not
    with caplog.at_level(logging.INFO, logger="sagm_jax.data"):
        chosen = open_compressed(index, cache, mode="auto", budget_gb=budget_gb)
    assert isinstance(chosen, jpeg_store.CompressedStore)
    assert "Using the compressed store" in caplog.text
    # An existing compressed store is used whatever its size, as a decoded one is.
    again = open_compressed(index, cache, mode="auto", budget_gb=1e-9)
    assert isinstance(again, jpeg_store.CompressedStore) and again.path == chosen.path
    decoded_store = open_compressed(index, cache, mode="auto")  # within the default budget
    assert isinstance(decoded_store, store.ImageStore)
    assert len(stores_in(cache)) == 2  # the two kinds have different keys
    np.testing.assert_array_equal(decoded_store.shapes, chosen.shapes)
