"""The decoded image store (``sagm_jax.data.store``): pixels (16-bit PNGs included), reuse,
staleness, corruption, concurrent builds, streaming and the choice between them. Tiny
images, short_side 24."""

import concurrent.futures
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from data_fixtures import pil_rgb, write_sixteen_bit_tree
from PIL import Image

from sagm_jax.data import canvas, decode, image_folder, store, streaming

SHORT, S = 24, 16  # short_side and image_size of the tests' stores
# (width, height, format): small (stored as decoded), larger (shrunk), grayscale PNG.
FILES = (
    (20, 30, "JPEG"),
    (31, 17, "PNG"),
    (100, 80, "JPEG"),  # stored 30x24; draft decodes at 1/2, eval at 1/4
    (24, 90, "PNG"),
    (64, 48, "JPEG"),
    (13, 21, "L"),
)


def _write(path, width, height, fmt, seed):
    """A smooth texture plus grain (like a photo; pure noise is the worst case of draft)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 2, width // 8 + 2, 3), np.uint8)
    smooth = np.asarray(Image.fromarray(base).resize((width, height), Image.BILINEAR))
    image = np.clip(smooth + rng.integers(-8, 9, smooth.shape), 0, 255).astype(np.uint8)
    pil = Image.fromarray(image)
    if fmt == "L":
        pil, fmt = pil.convert("L"), "PNG"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pil.save(path, format=fmt, quality=90)


def make_index(root, domains=("d0", "d1"), classes=("c0", "c1"), files=FILES):
    """root/<domain>/<class>/<k>.<ext>; files are dealt round-robin over the classes."""
    seed = 0
    for domain in domains:
        for k, (w, h, fmt) in enumerate(files):
            seed += 1
            ext = ".jpg" if fmt == "JPEG" else ".png"
            _write(
                os.path.join(root, domain, classes[k % len(classes)], f"{k}{ext}"), w, h, fmt, seed
            )
    return image_folder.scan_image_folder(str(root), missing_help="", cache_dir=None)


def open_store(index, cache, **kwargs):
    kwargs = {"mode": "cache", "workers": 1, "progress": False, **kwargs}
    return canvas.open_source(index, image_size=S, short_side=SHORT, cache_dir=str(cache), **kwargs)


def flat(index):
    return [p for env in index.paths for p in env]


def decoded(path):
    with Image.open(path) as image:
        return image.convert("RGB")


def expected_stored(path):
    image = decoded(path)
    h, w = decode.stored_shape(image.height, image.width, SHORT)
    return np.asarray(
        image if (h, w) == (image.height, image.width) else image.resize((w, h), Image.BILINEAR)
    )


def expected_eval(path):
    return np.asarray(decoded(path).resize((S, S), Image.BILINEAR))


def stores_in(cache):
    return sorted(os.listdir(os.path.join(cache, "stores")))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store built by two worker processes (the parallel path)."""
    index = make_index(tmp_path_factory.mktemp("tree"))
    cache = tmp_path_factory.mktemp("cache")
    return index, cache, open_store(index, cache, workers=2)


def test_gathered_and_eval_pixels_are_pils(built):
    index, _, source = built
    paths = flat(index)
    assert isinstance(source, store.ImageStore) and len(source) == len(paths)
    ids = np.array([5, 2, 2, 0, len(paths) - 1, 8, 9, 3])
    images, hw = source.gather(ids)
    assert images.dtype == np.uint8 and hw.dtype == np.int32
    assert images.shape == (len(ids), *source.canvas, 3)
    shapes = [expected_stored(p).shape[:2] for p in paths]
    assert source.canvas == tuple(np.max(shapes, axis=0))
    np.testing.assert_array_equal(source.shapes, shapes)
    for k, i in enumerate(ids):
        want = expected_stored(paths[i])
        h, w = want.shape[:2]
        np.testing.assert_array_equal(hw[k], (h, w))
        np.testing.assert_array_equal(images[k, :h, :w], want)
        assert not images[k, h:].any() and not images[k, :, w:].any()
    small = [i for i, p in enumerate(paths) if min(decoded(p).size) <= SHORT]
    for i in small:  # kept byte-for-byte as decoded
        np.testing.assert_array_equal(
            source.gather([i])[0][0, : shapes[i][0], : shapes[i][1]], np.asarray(decoded(paths[i]))
        )
    evals = source.eval_images(ids)
    assert evals.shape == (len(ids), S, S, 3) and evals.dtype == np.uint8
    for k, i in enumerate(ids):
        np.testing.assert_array_equal(evals[k], expected_eval(paths[i]))
    with pytest.raises(IndexError, match="ids must be in"):
        source.gather([len(paths)])


def test_second_open_decodes_nothing(built, monkeypatch):
    index, cache, first = built

    def forbidden(*args, **kwargs):
        raise AssertionError("decoded again")

    for module, name in (
        (store, "decode_file"),
        (store, "_decode_chunk"),
        (store, "build"),
        (canvas, "read_sizes"),
    ):
        monkeypatch.setattr(module, name, forbidden)
    again = open_store(index, cache)
    assert again.path == first.path and len(stores_in(cache)) == 1
    ids = np.arange(len(again))
    np.testing.assert_array_equal(again.gather(ids)[0], first.gather(ids)[0])


def counting_decodes(monkeypatch):
    calls = []
    real = store.decode_file

    def counted(path, *args):
        calls.append(path)
        return real(path, *args)

    monkeypatch.setattr(store, "decode_file", counted)
    return calls


def test_changed_files_give_a_new_store(tmp_path, monkeypatch, caplog):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:3])
    cache = tmp_path / "cache"
    old = open_store(index, cache)
    path = flat(index)[0]
    _write(path, *decoded(path).size, "JPEG", seed=99)  # new pixels (and size, mtime)
    calls = counting_decodes(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="sagm_jax.data"):
        new = open_store(index, cache)
    assert new.path != old.path and len(calls) == len(flat(index))
    assert "changed since" in caplog.text and old.path in caplog.text
    h, w = new.shapes[0]
    np.testing.assert_array_equal(new.gather([0])[0][0, :h, :w], expected_stored(path))
    st = os.stat(path)  # a touch alone (same bytes) is a change too
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert open_store(index, cache).path not in (old.path, new.path)


def _truncate(path):
    with open(os.path.join(path, store.PIXELS), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 7)


def _flip(name):
    def flip(path):
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    return flip


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_truncate, "truncated"),
        (_flip(store.PIXELS), "CRC-32"),
        (_flip(store.EVAL), "CRC-32"),
        (lambda path: os.remove(os.path.join(path, store.MANIFEST)), "no manifest"),
    ],
    ids=["truncated", "flipped-pixels", "flipped-eval", "no-manifest"],
)
def test_corrupt_store_is_rebuilt(tmp_path, monkeypatch, caplog, damage, reason):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:3])
    cache = tmp_path / "cache"
    first = open_store(index, cache)
    want = first.gather(np.arange(3))[0].copy()
    del first
    damage(os.path.join(cache, "stores", stores_in(cache)[0]))
    calls = counting_decodes(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="sagm_jax.data"):
        again = open_store(index, cache)
    assert reason in caplog.text and "Rebuilding" in caplog.text
    assert len(calls) == 3 and len(stores_in(cache)) == 1
    np.testing.assert_array_equal(again.gather(np.arange(3))[0], want)


def test_concurrent_builds_leave_one_store(tmp_path, monkeypatch, caplog):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:2])
    cache = tmp_path / "cache"
    barrier, waited = threading.Barrier(2), threading.local()
    real = store._decode_chunk

    def decode_together(job):  # both builds are under way before either finishes
        if not getattr(waited, "done", False):
            waited.done = True
            barrier.wait(timeout=30)
        return real(job)

    monkeypatch.setattr(store, "_decode_chunk", decode_together)
    with (
        caplog.at_level(logging.INFO, logger="sagm_jax.data"),
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        futures = [pool.submit(open_store, index, cache) for _ in range(2)]
        results = [f.result() for f in futures]
    assert "Another process built" in caplog.text  # the loser took the winner's store
    assert len(stores_in(cache)) == 1  # no temporary folder left behind
    assert results[0].path == results[1].path
    store.ImageStore.open(results[0].path)  # valid: checksums match
    ids = np.arange(len(results[0]))
    np.testing.assert_array_equal(results[0].gather(ids)[0], results[1].gather(ids)[0])


def test_streaming_matches_store(built):
    index, _, cached = built
    streamed = canvas.open_source(
        index, image_size=S, short_side=SHORT, mode="stream", progress=False
    )
    assert isinstance(streamed, streaming.StreamingSource)
    np.testing.assert_array_equal(streamed.shapes, cached.shapes)
    assert streamed.canvas == cached.canvas and streamed.image_size == cached.image_size
    ids = np.arange(len(cached))
    got, hw = streamed.gather(ids)
    want, _ = cached.gather(ids)
    np.testing.assert_array_equal(hw, cached.shapes)
    diff = np.abs(got.astype(int) - want)
    eval_diff = np.abs(streamed.eval_images(ids).astype(int) - cached.eval_images(ids))
    # draft reduces only JPEGs at least twice the wanted size; the rest are the store's.
    reduced = [
        i for i, p in enumerate(flat(index)) if p.endswith(".jpg") and min(decoded(p).size) > SHORT
    ]
    exact = np.setdiff1d(ids, reduced)
    assert len(reduced) == 4 and not diff[exact].any() and not eval_diff[exact].any()
    # Measured on these reduced images (8-px texture plus grain, reduced exactly 2x, where
    # libjpeg's scaled IDCT is furthest from PIL's antialiased bilinear): stored pixels mean
    # 3.1, max 36 levels; eval mean 1.4, max 7. (On a 2048x1536 photo-like JPEG to 320x427
    # the streaming module's doc gives mean 0.5, max 3.)
    region = np.concatenate([diff[i, :h, :w].ravel() for i, (h, w) in zip(reduced, hw[reduced])])
    assert region.mean() < 4 and region.max() <= 48
    assert eval_diff[reduced].mean() < 2 and eval_diff[reduced].max() <= 16
    streamed.close()


def test_auto_streams_over_budget_and_names_bad_files(tmp_path):
    index = make_index(tmp_path / "tree", domains=("d0",), files=FILES[:2])
    cache = tmp_path / "cache"
    tiny = open_store(index, cache, mode="auto", budget_gb=1e-9)
    assert isinstance(tiny, streaming.StreamingSource) and stores_in(cache) == []
    assert isinstance(open_store(index, cache, mode="auto"), store.ImageStore)
    with pytest.raises(ValueError, match="mode must be one of"):
        open_store(index, cache, mode="disk")
    bad = flat(index)[1]
    with open(bad, "wb") as f:
        f.write(b"not an image")
    with pytest.raises(image_folder.BadImageError, match=re.escape(bad)):
        open_store(index, cache)
    with pytest.raises(image_folder.BadImageError, match=re.escape(bad)):
        tiny.gather([1])


@pytest.fixture(scope="module")
def sixteen_bit_index(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sixteen_bit"))
    write_sixteen_bit_tree(root)
    return image_folder.scan_image_folder(root, missing_help="", cache_dir=None)


@pytest.mark.parametrize("mode", ["cache", "stream"])
def test_sixteen_bit_pixels_are_pils(sixteen_bit_index, tmp_path, mode):
    """16-bit PNGs, built and streamed, are torchvision's loader's pixels (data_fixtures)."""
    source = open_store(sixteen_bit_index, tmp_path, mode=mode)
    paths = flat(sixteen_bit_index)
    ids = np.arange(len(paths))
    images, hw = source.gather(ids)
    evals = source.eval_images(ids)
    for k, path in enumerate(paths):
        h, w = hw[k]
        np.testing.assert_array_equal(images[k, :h, :w], pil_rgb(path), err_msg=path)
        np.testing.assert_array_equal(evals[k], expected_eval(path), err_msg=path)


# ---- a build killed with SIGKILL ----------------------------------------------------
_KILLED_BUILD = """
import os, sys, time
from sagm_jax.data import canvas, image_folder, store

def slow_chunk(job):  # marks that a worker exists, then outlasts the test
    open(os.path.join(sys.argv[3], str(os.getpid())), "w").close()
    time.sleep(120)

def dies_mid_build(job):
    os._exit(3)

if __name__ == "__main__":
    tree, cache, markers, how = sys.argv[1:5]
    store._decode_chunk = slow_chunk if how == "workers" else dies_mid_build
    index = image_folder.scan_image_folder(tree, missing_help="", cache_dir=None)
    canvas.open_source(index, image_size=16, short_side=24, mode="cache", cache_dir=cache,
                      workers=2 if how == "workers" else 1, progress=False)
"""


def _start_build(tmp_path, tree, how):
    """A subprocess building the store of ``tree`` in ``tmp_path/cache`` (see _KILLED_BUILD)."""
    script, markers = tmp_path / "build.py", tmp_path / "markers"
    script.write_text(_KILLED_BUILD)
    markers.mkdir(exist_ok=True)
    args = [str(script), str(tree), str(tmp_path / "cache"), str(markers), how]
    return subprocess.Popen([sys.executable, *args]), markers


def _children(pid):
    """PIDs whose parent is ``pid``, read from /proc/<pid>/stat (field 4)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _running(pid):
    """Whether ``pid`` exists and is not a zombie (state Z: dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds processes through /proc")
def test_sigkilled_build_leaves_no_worker_processes(tmp_path):
    """SIGKILL of the building process ends its two decoding workers and the resource tracker
    within seconds (they used to stay, parent 1, blocked on a pipe)."""
    make_index(tmp_path / "tree", domains=("d0",), files=FILES[:4])
    child, markers = _start_build(tmp_path, tmp_path / "tree", "workers")
    orphans = []
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(markers)) < 2 and time.monotonic() < deadline:
            assert child.poll() is None, f"the build exited with {child.returncode}"
            time.sleep(0.1)
        assert len(os.listdir(markers)) == 2, "the two workers did not start within 60 s"
        orphans = _children(child.pid)
        workers = {int(name) for name in os.listdir(markers)}
        assert workers <= set(orphans)
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while any(map(_running, orphans)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in orphans if _running(pid)]
        assert not left, f"processes of the killed build still run: {left}"
    finally:
        child.kill()
        for pid in orphans:  # this test's own processes, should the fix fail
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_next_build_removes_dead_owners_build_folders_only(tmp_path):
    """A build folder whose process died mid-build is removed by the next build; one whose
    owner (a build under way in this process) is alive is kept and finishes."""
    cache = tmp_path / "cache"
    dead_tree, live_tree = tmp_path / "dead", tmp_path / "live"
    dead_index = make_index(dead_tree, domains=("d0",), files=FILES[:2])
    live_index = make_index(live_tree, domains=("d0",), files=FILES[2:4])
    child, _ = _start_build(tmp_path, dead_tree, "exit")
    assert child.wait(timeout=60) == 3
    stale = [name for name in stores_in(cache) if name.startswith(".build-")]
    assert len(stale) == 1  # what the killed build left

    live_started, release = threading.Event(), threading.Event()
    real = store._decode_chunk

    def decode(job):  # the live build waits inside its decoding until released
        if str(live_tree) in job[4][0]:
            live_started.set()
            assert release.wait(timeout=30)
        return real(job)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        store._decode_chunk = decode
        try:
            live = pool.submit(open_store, live_index, cache)
            assert live_started.wait(timeout=30)
            building = [n for n in stores_in(cache) if n.startswith(".build-")]
            live_folder = [n for n in building if n not in stale]
            rebuilt = open_store(dead_index, cache)
            assert stale[0] not in stores_in(cache)  # removed: its owner is gone
            assert len(live_folder) == 1 and live_folder[0] in stores_in(cache)  # kept
        finally:
            release.set()
            store._decode_chunk = real
        live = live.result()
    assert sorted(stores_in(cache)) == sorted(
        os.path.basename(s.path) for s in (rebuilt, live)
    )
    for built_store, index in ((rebuilt, dead_index), (live, live_index)):
        ids = np.arange(len(built_store))
        want = [expected_stored(p) for p in flat(index)]
        got, hw = built_store.gather(ids)
        for k, image in enumerate(want):
            np.testing.assert_array_equal(got[k, : hw[k][0], : hw[k][1]], image)
