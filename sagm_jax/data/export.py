"""``python -m sagm_jax.data.export --dataset=RotatedDigits --out=DIR``: an in-memory
dataset written as an RGB image folder.

Writes DomainBed's image-folder layout, ``DIR/<domain>/<class>/<row>.png``, from a
dataset of the registry that is built in memory (RotatedDigits, offline; RotatedMNIST
and ColoredMNIST with their ``--data_dir``), so that ``configs/image_folder.py`` and the
ResNets (MixStyle included) can run on it without a download. Every image of
environment ``e`` goes to ``DIR/<domain e>/<class y>/<row>.png``, with

    rgb[h, w, :] = round(255 * x[h, w, :])            for 3 channels,
    rgb[h, w, :] = round(255 * x[h, w, 0]) (3 times)   for one (grey to RGB),
    rgb[h, w, :] = round(255 * [x[h, w, 0], x[h, w, 1], 0])  for two (ColoredMNIST),

``x`` in [0, 1] as the in-memory dataset serves it, at its own size (28x28; the image
folder's pipeline resizes to ``image_size``). Folder names sort in the dataset's order,
as the image folder lists its environments and classes by sorted name: a domain's name
as it is when the names already sort so and are plain file names (RotatedDigits' ``0``,
``15``, ..., ``75``), else prefixed with its index (``0_+90%``); classes are the label,
zero-padded (``0`` .. ``9``). Rows keep their order within each class (``00012.png``).
The folder must not exist yet or be empty; exit 2 with one message otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np

from sagm_jax.data import registry


def domain_folders(names: list[str]) -> list[str]:
    """Folder names of the environments ``names`` that sort in their order (module doc)."""
    plain = all(re.fullmatch(r"[\w.+%-]+", n) and n not in (".", "..") for n in names)
    if plain and sorted(names) == list(names):
        return list(names)
    width = len(str(len(names) - 1))
    safe = [re.sub(r"[^\w.+%-]", "_", n) for n in names]
    return [f"{i:0{width}d}_{n}" for i, n in enumerate(safe)]


def to_rgb(images: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, 3] of float images [N, H, W, C] in [0, 1], C in 1..3 (module doc)."""
    channels = images.shape[-1]
    if channels == 1:
        images = np.repeat(images, 3, axis=-1)
    elif channels == 2:
        images = np.concatenate([images, np.zeros_like(images[..., :1])], axis=-1)
    elif channels != 3:
        raise ValueError(f"expected images with 1, 2 or 3 channels, got {channels}")
    return np.round(np.clip(images, 0.0, 1.0) * 255.0).astype(np.uint8)


def in_memory() -> list[str]:
    """The registry's datasets built in memory, those export writes."""
    return [name for name, spec in registry.DATASETS.items() if spec.kind == "array"]


def export(dataset: str, out: str, data_dir: str | None = None, data_seed: int = 0) -> dict:
    """Write in-memory ``dataset`` to ``out`` as an RGB image folder; returns the number
    of images per domain folder. ValueError when the dataset is not built in memory or
    ``out`` holds files already."""
    from PIL import Image

    spec = registry.get_spec(dataset)
    if spec.kind != "array":
        raise ValueError(
            f"--dataset={dataset} is an image folder already; export writes the datasets "
            f"built in memory: {', '.join(in_memory())}."
        )
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"--out={out} is not empty; choose a new folder.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out={out} is a file; choose a new folder.")
    source = spec.build(data_dir, data_seed)
    width = len(str(source.num_classes - 1))
    counts = {}
    for folder, images, labels in zip(
        domain_folders(source.env_names), source.images, source.labels
    ):
        rgb = to_rgb(images)
        for label in range(source.num_classes):
            os.makedirs(os.path.join(out, folder, f"{label:0{width}d}"), exist_ok=True)
        for row, (image, label) in enumerate(zip(rgb, labels)):
            path = os.path.join(out, folder, f"{int(label):0{width}d}", f"{row:05d}.png")
            Image.fromarray(image).save(path)
        counts[folder] = len(labels)
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.data.export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dataset", required=True, help=f"one of {', '.join(in_memory())}")
    parser.add_argument("--out", required=True, help="the image folder to write (new or empty)")
    parser.add_argument("--data_dir", default=None, help="where RotatedMNIST/ColoredMNIST are")
    parser.add_argument("--data_seed", type=int, default=0, help="the environments' shuffle")
    args = parser.parse_args(argv)
    try:
        counts = export(args.dataset, args.out, args.data_dir, args.data_seed)
    except (ValueError, KeyError, OSError) as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    listed = ", ".join(f"{folder} {n}" for folder, n in counts.items())
    print(f"{args.out}: {sum(counts.values())} images ({listed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
