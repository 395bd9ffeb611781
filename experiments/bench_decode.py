"""JPEG decoders for DomainNet-sized data: from the original files and from the compressed store.

Writes a synthetic DomainNet-like image folder (DomainNet's 6 domains and their share of
its 586,575 images, 345 classes, JPEG sizes and qualities per domain as assumed below,
content drawn per domain: photo crops, paintings, flat-colour clip art, infographics,
pencil sketches, 256x256 doodles), builds the compressed store
(``sagm_jax.data.jpeg_store``) from it, and prints:

* decode images/s PER CORE (images per CPU-second of this process, one thread) of the
  training input (the stored canvas image, ``decode.stored_shape``) and of the
  evaluation input (S x S), for each decoder, (a) from the original files and (b) from
  the compressed store's records; and the store's own ``gather`` / ``eval_images`` in
  batches with 1 and all threads (the wall-clock speed-up shows whether the decoder
  releases the GIL);
* the per-core rate that 16 cores need to feed one H100 (training: a bf16 SAGM step's
  ~2,700 images/s; evaluation: the forward-only rate, about 3x ERM's measured bf16
  fwd+bwd 4,964 images/s) and whether each decoder meets it;
* the pixel difference (mean / max grey levels over pixels and channels) from PIL's
  decode of the original file (+ PIL's bilinear resize, torchvision's loader and
  Resize): of each decoder's training and evaluation input;
* the store's size per image and in all, the share of originals kept as their bytes,
  the build rate; and the decoded store's size per image for comparison.

Decoders: PIL's full decode (+ resize), PIL with ``draft`` (libjpeg's scaled IDCT, then
resize; what streaming does), simplejpeg (libjpeg-turbo; full, and scaled with
``min_height``/``min_width``), PyTurboJPEG if its system library loads (it is not a
dependency). NVIDIA DALI's nvJPEG is a GPU path: not measured here (no GPU).

Assumed DomainNet sizes (no published per-image size distribution was found): quickdraw
is 256x256 rendered strokes; the other domains are web images of a few hundred pixels,
infographics larger. Mean bytes per image were checked against DomainNet's download
archives (clipart 1.2 GB / 48,129 images, infograph 4.0 GB / 51,605, painting 3.7 GB /
72,266, quickdraw 0.44 GB / 172,500, real 5.6 GB / 172,947, sketch 2.5 GB / 69,128:
archive sizes as listed on the dataset's page, from memory, not re-measured here); the
script prints its own mean file size per domain beside these.

    python experiments/bench_decode.py [--images 3000] [--sample 400] [--folder DIR]

Runs without TensorFlow (checked at the end).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import simplejpeg
from PIL import Image, ImageDraw, features

from sagm_jax.data import canvas, decode, image_folder, jpeg_store, store

IMAGE_SIZE, SHORT_SIDE = 224, 320
# One H100 (experiments/device_report.py's figures): a bf16 SAGM step consumes about 2,700
# training images/s; evaluation runs at the forward-only rate, about 3x ERM's bf16 fwd+bwd.
TRAIN_IMAGES_PER_S = 2_700
EVAL_IMAGES_PER_S = 3 * 4_964
CORES = 16
# name: (DomainBed's image count, assumed shorter-side range and longest side in px, JPEG
# quality range, archive MB as listed by DomainNet's download page)
DOMAINS = {
    "clipart": (48_129, (250, 600), 900, (80, 95), 1_200),
    "infograph": (51_605, (350, 700), 1200, (70, 90), 4_000),
    "painting": (72_266, (300, 600), 900, (75, 95), 3_700),
    "quickdraw": (172_500, (256, 256), 256, (75, 75), 440),
    "real": (172_947, (250, 480), 640, (70, 90), 5_600),
    "sketch": (69_128, (300, 600), 800, (70, 90), 2_500),
}
CLASSES = 345


# ---- a DomainNet-like folder ---------------------------------------------------------
def _photos() -> list[np.ndarray]:
    """Two real photographs (scikit-learn's sample images, 427x640) as a source of photo content."""
    from sklearn.datasets import load_sample_images

    return list(load_sample_images().images)


def _pink_noise(rng, h, w) -> np.ndarray:
    """float [h, w, 3] in [0, 1] with a 1/f amplitude spectrum (natural images' statistics)."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    amplitude = 1.0 / np.maximum(np.hypot(fy, fx), 1.0 / max(h, w))
    out = np.empty((h, w, 3))
    for c in range(3):
        phase = rng.uniform(0, 2 * np.pi, amplitude.shape)
        out[..., c] = np.fft.irfft2(amplitude * np.exp(1j * phase), s=(h, w))
    out -= out.min()
    return out / max(out.max(), 1e-9)


def _photo_crop(rng, photos, h, w) -> np.ndarray:
    src = photos[rng.integers(len(photos))]
    sh, sw = src.shape[:2]
    ch, cw = int(rng.integers(sh // 4, sh)), int(rng.integers(sw // 4, sw))
    y, x = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
    crop = Image.fromarray(src[y : y + ch, x : x + cw]).resize((w, h), Image.BICUBIC)
    out = np.asarray(crop).astype(np.float64) * rng.uniform(0.7, 1.3, 3)
    if rng.random() < 0.5:
        out = out[:, ::-1]
    return out


def _strokes(rng, h, w, n, width, colour) -> Image.Image:
    image = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _ in range(n):
        points = np.cumsum(rng.normal(0, max(h, w) / 12, (int(rng.integers(3, 12)), 2)), axis=0)
        points += (rng.uniform(0, w), rng.uniform(0, h))
        draw.line([tuple(p) for p in points], fill=colour, width=width)
    return image


def make_image(domain: str, rng, photos, h: int, w: int) -> Image.Image:
    """Content typical of the domain (module doc)."""
    if domain == "real":
        out = _photo_crop(rng, photos, h, w) + rng.normal(0, 2, (h, w, 3))
    elif domain == "painting":
        brush = _pink_noise(rng, h, w) * 255
        out = 0.6 * _photo_crop(rng, photos, h, w) + 0.4 * brush
        out = np.asarray(
            Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))
            .resize((max(1, w // 3), max(1, h // 3)), Image.BILINEAR)
            .resize((w, h), Image.BICUBIC)
        )
        out = out + rng.normal(0, 4, (h, w, 3))
    elif domain == "clipart":  # flat-colour shapes with dark outlines on white
        image = Image.new("RGB", (w, h), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(3, 9))):
            x0, y0 = rng.uniform(0, w * 0.8), rng.uniform(0, h * 0.8)
            box = [x0, y0, x0 + rng.uniform(w * 0.1, w * 0.5), y0 + rng.uniform(h * 0.1, h * 0.5)]
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape(
                box,
                fill=tuple(int(v) for v in rng.integers(0, 256, 3)),
                outline=(20, 20, 20),
                width=3,
            )
        out = np.asarray(image).astype(np.float64) - _pink_noise(rng, h, w) * 12  # shading
    elif domain == "infograph":
        out = np.full((h, w, 3), rng.integers(200, 256, 3), np.float64)
        for _ in range(int(rng.integers(4, 10))):  # flat panels
            y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
            out[y : y + int(rng.integers(20, h // 2)), x : x + int(rng.integers(20, w // 2))] = (
                rng.integers(0, 256, 3)
            )
        ph, pw = h // 3, w // 3
        y, x = int(rng.integers(0, h - ph)), int(rng.integers(0, w - pw))
        out[y : y + ph, x : x + pw] = _photo_crop(rng, photos, ph, pw)
        text = rng.random((h // 4, w // 3)) < 0.15  # rows of small glyph-like marks
        rows = np.kron(text, np.ones((2, 2)))[: h // 2, : 2 * (w // 3)]
        ty, tx = int(rng.integers(0, h - rows.shape[0])), int(rng.integers(0, w - rows.shape[1]))
        out[ty : ty + rows.shape[0], tx : tx + rows.shape[1]][rows > 0] = 30
    elif domain == "sketch":
        grey = int(rng.integers(30, 120))
        out = np.asarray(_strokes(rng, h, w, int(rng.integers(10, 40)), 2, (grey,) * 3)).astype(
            np.float64
        )
        out = out - _pink_noise(rng, h, w) * 10  # paper grain
    else:  # quickdraw
        out = np.asarray(_strokes(rng, h, w, int(rng.integers(2, 7)), 3, (0, 0, 0)))
    return Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))


def write_folder(root: str, images: int, seed: int = 0) -> dict:
    """root/<domain>/<class>/<k>.jpg, images shared out by DomainNet's domain sizes; returns
    {domain: mean file bytes}."""
    rng = np.random.default_rng(seed)
    photos = _photos()
    total = sum(v[0] for v in DOMAINS.values())
    mean_bytes = {}
    for domain, (count, (lo, hi), longest, (q_lo, q_hi), _) in DOMAINS.items():
        n = max(CLASSES, round(images * count / total))  # every class in every domain
        written = 0
        for k in range(n):
            short = int(rng.integers(lo, hi + 1))
            long_side = int(rng.integers(short, max(short, longest) + 1))
            h, w = (short, long_side) if rng.random() < 0.7 else (long_side, short)
            image = make_image(domain, rng, photos, h, w)
            folder = os.path.join(root, domain, f"class_{k % CLASSES:03d}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{domain}_{k:06d}.jpg")
            image.save(path, "JPEG", quality=int(rng.integers(q_lo, q_hi + 1)))
            written += os.path.getsize(path)
        mean_bytes[domain] = written / n
    return mean_bytes


# ---- decoders ------------------------------------------------------------------------
def pil_full(data: bytes, shape) -> np.ndarray:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    if image.size != (shape[1], shape[0]):
        image = image.resize((int(shape[1]), int(shape[0])), Image.BILINEAR)
    return np.asarray(image)


def pil_draft(data: bytes, shape) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (int(shape[1]), int(shape[0])))
    image = image.convert("RGB")
    if image.size != (shape[1], shape[0]):
        image = image.resize((int(shape[1]), int(shape[0])), Image.BILINEAR)
    return np.asarray(image)


def _resized(array: np.ndarray, shape) -> np.ndarray:
    if array.shape[:2] == tuple(shape):
        return array
    return np.asarray(Image.fromarray(array).resize((int(shape[1]), int(shape[0])), Image.BILINEAR))


def simplejpeg_full(data: bytes, shape) -> np.ndarray:
    return _resized(simplejpeg.decode_jpeg(data, colorspace="RGB"), shape)


def simplejpeg_scaled(data: bytes, shape) -> np.ndarray:
    array = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_height=int(shape[0]), min_width=int(shape[1])
    )
    return _resized(array, shape)


def turbojpeg_decoders():
    """PyTurboJPEG's full and scaled decoders, or the reason it is not available."""
    try:
        import turbojpeg

        jpeg = turbojpeg.TurboJPEG()
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or no system library
        return {}, f"{type(e).__name__}: {e}"

    def full(data, shape):
        return _resized(jpeg.decode(data, pixel_format=turbojpeg.TJPF_RGB), shape)

    def scaled(data, shape):
        h, w = jpeg.decode_header(data)[:2]
        factors = [
            f
            for f in jpeg.scaling_factors
            if h * f[0] // f[1] >= shape[0] and w * f[0] // f[1] >= shape[1]
        ]
        factor = min(factors, key=lambda f: f[0] / f[1]) if factors else (1, 1)
        out = jpeg.decode(data, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=factor)
        return _resized(out, shape)

    return {"PyTurboJPEG full": full, "PyTurboJPEG scaled": scaled}, None


def per_core_rate(function, items) -> float:
    """Images per CPU-second of this process, one thread; best of two passes."""
    best = 0.0
    for _ in range(2):
        start = time.process_time()
        for item in items:
            function(*item)
        best = max(best, len(items) / max(time.process_time() - start, 1e-9))
    return best


def difference(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, int]:
    diffs = [np.abs(g.astype(np.int16) - w).ravel() for g, w in zip(got, want)]
    flat = np.concatenate(diffs)
    return float(flat.mean()), int(flat.max())


def _busy(seconds: float) -> float:
    """CPU-seconds per second that one busy process gets."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        pass
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def free_cores(cores: int, seconds: float = 1.5) -> float:
    """Cores this program actually gets now: the CPU share of ``cores`` busy processes, summed
    (other jobs on a shared machine take the rest)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(cores, mp_context=context) as pool:
        list(pool.map(_busy, [0.1] * cores))  # started
        return sum(pool.map(_busy, [seconds] * cores))


def gil_probe(decoders: dict, record: bytes, seconds: float = 2.0) -> None:
    """How fast a pure-Python loop runs while another thread decodes ``record`` without pause,
    relative to the loop alone: about 1 when the decoder releases the GIL (and a core is
    free for it), about 0.5 or less when it holds the GIL."""

    def loop():
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = loop()
    for name, function in decoders.items():
        stop = threading.Event()

        def background(function=function, stop=stop):
            while not stop.is_set():
                function(record, (0, 0))

        thread = threading.Thread(target=background)
        thread.start()
        try:
            share = loop() / alone
        finally:
            stop.set()
            thread.join()
        print(f"{name:<20} Python loop at {share:.0%} of its speed alone")


def verdict(rate: float, need: float) -> str:
    return "yes" if rate >= need else "no"


# ---- the benchmark -------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--images", type=int, default=3000, help="images in the folder (at least 345 a domain)"
    )
    parser.add_argument("--sample", type=int, default=400, help="images each decoder decodes")
    parser.add_argument("--folder", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    work = args.folder or tempfile.mkdtemp(prefix="bench_decode-")
    root, cache = os.path.join(work, "DomainNetLike"), os.path.join(work, "cache")
    cores = decode.cpu_count()
    need_train, need_eval = TRAIN_IMAGES_PER_S / CORES, EVAL_IMAGES_PER_S / CORES
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), cpu)
    print(f"# bench_decode: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"CPU: {cpu}, {cores} usable cores; Python {platform.python_version()}")
    print(
        "load average at the start (other processes' use of these cores): "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
        + f"; {cores} busy processes got {free_cores(cores):.1f} cores in all"
    )
    print(
        f"PIL {Image.__version__} (libjpeg-turbo {features.version('jpg')}), "
        f"simplejpeg {simplejpeg.__version__}"
    )

    start = time.perf_counter()
    mean_bytes = write_folder(root, args.images)
    print(f"\nWrote {args.images} images under {root} in {time.perf_counter() - start:.0f} s.")
    print("domain      images  mean file KB  (DomainNet archive KB per image, assumed)")
    total = sum(v[0] for v in DOMAINS.values())
    for domain, (count, _, _, _, archive_mb) in DOMAINS.items():
        print(
            f"{domain:<10} {max(CLASSES, round(args.images * count / total)):>7} {mean_bytes[domain] / 1e3:>13.1f}"
            f"  ({archive_mb * 1e3 / count:.1f})"
        )

    index = image_folder.scan_image_folder(root, missing_help="", cache_dir=None)
    paths = [p for env in index.paths for p in env]
    sizes = decode.read_sizes(paths, progress=False)
    start = time.perf_counter()
    compressed = canvas.open_source(
        index,
        image_size=IMAGE_SIZE,
        short_side=SHORT_SIDE,
        mode="compressed",
        cache_dir=cache,
        progress=False,
    )
    build_s = time.perf_counter() - start
    n = len(compressed)
    files = compressed.manifest["files"]
    train_bytes = sum(f["bytes"] for name, f in files.items() if name.startswith("train-"))
    eval_bytes = sum(f["bytes"] for name, f in files.items() if name.startswith("eval-"))
    decoded_bytes = store.estimate_store_bytes(sizes, IMAGE_SIZE, SHORT_SIDE)
    stored_pixels = decoded_bytes / 3
    print(
        f"\n## Stores ({n} images; stored shorter side {SHORT_SIDE}, eval {IMAGE_SIZE}x{IMAGE_SIZE})"
    )
    print(
        f"build: {build_s:.1f} s, {n / build_s:.0f} images/s with {cores} worker processes "
        f"({n / build_s / cores:.0f} per core)"
    )
    print(
        f"compressed store: {compressed.nbytes / 2**20:.1f} MiB, {compressed.nbytes / n / 1e3:.1f} KB"
        f" per image (training records {train_bytes / n / 1e3:.1f} KB, evaluation records "
        f"{eval_bytes / n / 1e3:.1f} KB); {compressed.kept.mean():.1%} of the training records"
        " are the original files' bytes"
    )
    print(
        f"  {compressed.nbytes / stored_pixels:.3f} bytes per stored pixel (training + eval "
        f"pixels; jpeg_store.BYTES_PER_PIXEL = {jpeg_store.BYTES_PER_PIXEL} is open_source's "
        "estimate)"
    )
    estimate = jpeg_store.estimate_bytes(sizes, IMAGE_SIZE, SHORT_SIDE)
    print(
        f"  open_source's estimate for this folder: {estimate / 2**20:.1f} MiB "
        f"({estimate / compressed.nbytes:.2f}x the measured size)"
    )
    print(
        f"decoded store (for comparison): {decoded_bytes / 2**20:.1f} MiB, "
        f"{decoded_bytes / n / 1e3:.1f} KB per image"
    )
    print(
        f"at this size per image, DomainBed's 586,575 DomainNet images: compressed "
        f"{compressed.nbytes / n * 586_575 / 2**30:.0f} GiB, decoded "
        f"{decoded_bytes / n * 586_575 / 2**30:.0f} GiB"
    )

    # The sample every decoder decodes, and PIL's reference pixels for it.
    rng = np.random.default_rng(1)
    ids = np.sort(rng.choice(n, min(args.sample, n), replace=False))
    originals = []
    for i in ids:
        with open(paths[i], "rb") as f:
            originals.append(f.read())
    shapes = [tuple(int(x) for x in compressed.shapes[i]) for i in ids]
    square = (IMAGE_SIZE, IMAGE_SIZE)
    want_train, want_eval = [], []
    for i, shape in zip(ids, shapes):
        small, evaluation = decode.decode_file(paths[i], sizes[i], shape, IMAGE_SIZE)
        want_train.append(small)
        want_eval.append(evaluation)
    train_records = [bytes(compressed._train.record(i)) for i in ids]
    eval_records = [bytes(compressed._eval.record(i)) for i in ids]

    print("\n## Per domain: the compressed store and its pixels (sample, simplejpeg)")
    print("domain      kept  KB/image  bytes/stored px  training diff mean/max  eval diff mean/max")
    domain_of = np.concatenate([[d] * len(env) for d, env in enumerate(index.paths)])
    lengths = {
        stream: np.diff(getattr(compressed, f"_{stream}").offsets) for stream in ("train", "eval")
    }
    for d, domain in enumerate(index.env_names):
        mine = domain_of == d
        pixels = compressed.shapes[mine].astype(np.int64).prod(axis=1).sum()
        pixels += mine.sum() * IMAGE_SIZE**2
        stored = lengths["train"][mine].sum() + lengths["eval"][mine].sum()
        sample = [k for k, i in enumerate(ids) if domain_of[i] == d]
        train_diff = difference(
            [jpeg_store.decode(train_records[k]) for k in sample], [want_train[k] for k in sample]
        )
        eval_diff = difference(
            [jpeg_store.decode(eval_records[k]) for k in sample], [want_eval[k] for k in sample]
        )
        print(
            f"{domain:<10} {compressed.kept[mine].mean():>5.0%} {stored / mine.sum() / 1e3:>9.1f}"
            f" {stored / pixels:>16.3f} {train_diff[0]:>16.2f} / {train_diff[1]:<5}"
            f" {eval_diff[0]:>12.2f} / {eval_diff[1]}"
        )
    encoded = [k for k, i in enumerate(ids) if not compressed.kept[i]]
    mean, top = difference(
        [jpeg_store.decode(train_records[k]) for k in encoded], [want_train[k] for k in encoded]
    )
    print(
        f"re-encoded training images only ({len(encoded)} of the sample): diff mean {mean:.2f}, "
        f"max {top}; kept originals: 0 (checked at build)"
    )

    print("\n## Quality of the re-encoded records (every sampled image re-encoded; simplejpeg)")
    print("quality subsampling  KB train  KB eval  train diff mean/max  eval diff  decode/core")
    for quality, subsampling in ((85, "420"), (90, "420"), (90, "444"), (95, "420"), (95, "444")):

        def encode(image, quality=quality, subsampling=subsampling):
            return simplejpeg.encode_jpeg(
                image, quality=quality, colorspace="RGB", colorsubsampling=subsampling
            )

        trains, evals = [encode(x) for x in want_train], [encode(x) for x in want_eval]
        train_diff = difference([simplejpeg.decode_jpeg(r) for r in trains], want_train)
        eval_diff = difference([simplejpeg.decode_jpeg(r) for r in evals], want_eval)
        rate = per_core_rate(simplejpeg.decode_jpeg, [(r,) for r in trains])
        print(
            f"{quality:>7} {subsampling:>11} {np.mean([len(r) for r in trains]) / 1e3:>9.1f}"
            f" {np.mean([len(r) for r in evals]) / 1e3:>8.1f} {train_diff[0]:>12.2f} / "
            f"{train_diff[1]:<5} {eval_diff[0]:>5.2f} / {eval_diff[1]:<4} {rate:>10.0f}"
        )
    print(f"(the store uses quality {jpeg_store.QUALITY}, {jpeg_store.SUBSAMPLING})")

    decoders = {
        "PIL full": pil_full,
        "PIL draft": pil_draft,
        "simplejpeg full": simplejpeg_full,
        "simplejpeg scaled": simplejpeg_scaled,
    }
    turbo, why_not = turbojpeg_decoders()
    decoders.update(turbo)

    header = (
        f"{'decoder':<20} {'img/s/core':>10} {'needs':>6} {'meets':>5} {'mean diff':>9} {'max':>4}"
    )
    rows = []

    def row(name, function, items, want, need):
        rate = per_core_rate(function, items)
        got = [function(*item) for item in items]
        mean, top = difference(got, want)
        rows.append((name, rate))
        print(
            f"{name:<20} {rate:>10.0f} {need:>6.0f} {verdict(rate, need):>5} {mean:>9.2f} {top:>4}"
        )

    print(f"\n## Decode per core, {len(ids)} images (one thread; images per CPU-second)")
    print(
        f"needs: {CORES} cores feeding {TRAIN_IMAGES_PER_S:,} training images/s "
        f"({need_train:.0f} per core) or {EVAL_IMAGES_PER_S:,} evaluation images/s "
        f"({need_eval:.0f} per core); diff: grey levels from PIL's decode of the original + "
        "PIL's bilinear resize"
    )
    for label, targets, want, need in (
        ("training input (stored canvas image)", shapes, want_train, need_train),
        (
            f"evaluation input ({IMAGE_SIZE}x{IMAGE_SIZE})",
            [square] * len(ids),
            want_eval,
            need_eval,
        ),
    ):
        print(f"\n### {label}\n(a) from the original files\n{header}")
        for name, function in decoders.items():
            row(name, function, list(zip(originals, targets)), want, need)
        print(f"(b) from the compressed store's records\n{header}")
        records = train_records if want is want_train else eval_records
        for name in ("simplejpeg full", "PIL full", "PIL draft", *turbo):
            row(name, decoders[name], list(zip(records, targets)), want, need)
        if want is want_eval:  # the design not chosen: the eval image from the training record
            row(
                "simplejpeg+resize*",
                simplejpeg_full,
                list(zip(train_records, targets)),
                want,
                need,
            )
            print("* made at read time from the stored training image (not stored separately)")
    if why_not:
        print(f"\nPyTurboJPEG: not measured ({why_not}); it needs a system libturbojpeg.")
    print("NVIDIA DALI (nvJPEG on the GPU): not measured, no GPU on this machine.")

    print(
        f"\n## The store's gather / eval_images, batches of 96 / 128 (wall clock; gather fills "
        f"canvases of {compressed.canvas[0]}x{compressed.canvas[1]}, the largest stored h and w)"
    )
    batches = [rng.choice(n, 96) for _ in range(8)]
    for threads in sorted({1, cores}):
        source = jpeg_store.CompressedStore.open(compressed.path, threads=threads)
        source.gather(batches[0])  # map the pages
        for name, call, size in (
            ("gather", source.gather, 96),
            ("eval_images", source.eval_images, 128),
        ):
            wall, cpu0 = time.perf_counter(), time.process_time()
            for batch in batches:
                call(batch if size == 96 else rng.choice(n, 128))
            wall, cpu_s = time.perf_counter() - wall, time.process_time() - cpu0
            count = len(batches) * size
            print(
                f"{name:<12} {threads} thread(s): {count / wall:>7.0f} images/s wall, "
                f"{count / cpu_s:>6.0f} per CPU-second, CPU use {cpu_s / wall:.0%} of one core"
            )
        source.close()
    compressed.close()
    print(
        "\n## The GIL: a Python thread's speed while another decodes a large JPEG (needs a "
        "free core to separate: compare with the control)"
    )
    largest = max(range(len(ids)), key=lambda k: len(originals[k]))
    gil_probe(
        {
            "simplejpeg": lambda data, _: simplejpeg.decode_jpeg(data),
            "PIL": lambda data, _: Image.open(io.BytesIO(data)).convert("RGB"),
            "pure Python (control)": lambda data, _: sum(range(20_000)),  # holds the GIL
        },
        originals[largest],
    )
    print(
        "\n(all threads over 1 thread is the pool's speed-up: near the core count only if the "
        "decoder releases the GIL and the cores are free; CPU use above 100% of one core shows "
        "threads decoding at once, which a decoder holding the GIL cannot do)"
    )
    print(
        "load average at the end: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
        + f"; {cores} busy processes got {free_cores(cores):.1f} cores in all"
    )
    print(f"\nTensorFlow imported: {'tensorflow' in sys.modules}")
    if args.folder is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
