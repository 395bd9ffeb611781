"""One original image file to the stored size: the decoding every image source shares.

Owns what the decoded store (``store.py``), the compressed store (``jpeg_store.py``) and
streaming (``streaming.py``) do alike to an image folder's files: the files in flat id order
(``flat_paths``), their header sizes (``read_size``, ``read_sizes``), the stored shape
(``stored_shape``: the shorter side shrunk to ``short_side``, aspect kept), the full decode
with torchvision's loader and PIL's resizes (``decode_file``), the reduced-size JPEG decode of
streaming (``decode_draft``), and the serving side every source shares: the ids checked
(``check_ids``) and each image placed on a zero-padded canvas row (``place``). The reasons
behind the decodes are in ``store.py``'s doc (stored and evaluation images) and
``streaming.py``'s (``draft``). No TensorFlow here.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
from PIL import Image

from sagm_jax import formatting
from sagm_jax.data.image_folder import BadImageError


def cpu_count() -> int:
    """The CPU cores this process may use (its affinity where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def flat_paths(index) -> list[str]:
    """The files of a ``FolderIndex`` in flat id order: environment 0's, then 1's, ..."""
    return [p for env in index.paths for p in env]


def stored_shape(height: int, width: int, short_side: int) -> tuple[int, int]:
    """Images whose shorter side exceeds short_side are shrunk (aspect kept, sides rounded) so
    the shorter side equals short_side; others are kept as they are."""
    height, width, short_side = int(height), int(width), int(short_side)
    short = min(height, width)
    if short <= short_side:
        return height, width

    def scaled(side):  # round(side * short_side / short), halves up, in integers
        return max(1, (2 * side * short_side + short) // (2 * short))

    if height <= width:
        return short_side, scaled(width)
    return scaled(height), short_side


def stored_shapes(sizes: np.ndarray, short_side: int) -> np.ndarray:
    """int32 [N, 2]: ``stored_shape`` of every original (h, w) in ``sizes``."""
    shapes = [stored_shape(int(h), int(w), short_side) for h, w in sizes]
    return np.asarray(shapes, dtype=np.int32).reshape(-1, 2)


def read_size(path: str) -> tuple[int, int]:
    """(h, w) from the file's header, without decoding."""
    try:
        with Image.open(path) as image:
            w, h = image.size
    except Exception as e:  # PIL raises many types
        raise BadImageError(f"{path}: cannot read the image header ({type(e).__name__}: {e})")
    return h, w


def read_sizes(paths: list[str], *, progress: bool = True) -> np.ndarray:
    """int32 [N, 2] (h, w) of every file, from headers (threads: mostly file I/O)."""
    with concurrent.futures.ThreadPoolExecutor(min(32, 2 * cpu_count())) as pool:
        sizes = list(
            formatting.progress(
                iterable=pool.map(read_size, paths, chunksize=64),
                total=len(paths),
                desc="Reading image headers",
                unit="img",
                disable=not progress,
            )
        )
    return np.asarray(sizes, dtype=np.int32).reshape(-1, 2)


def decode_file(path: str, size, stored, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Full decode (torchvision's loader): (stored uint8 [h, w, 3], eval uint8 [S, S, 3]).
    ``size`` is the (h, w) the header gave, ``stored`` the stored (h, w)."""
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except Exception as e:  # PIL raises many types
        raise BadImageError(f"{path}: does not decode ({type(e).__name__}: {e})")
    if rgb.size != (size[1], size[0]):
        raise BadImageError(
            f"{path}: decodes to {rgb.size[1]}x{rgb.size[0]} (h x w) but its header said "
            f"{size[0]}x{size[1]}; was it rewritten while the store was built?"
        )
    small = (
        rgb
        if rgb.size == (stored[1], stored[0])
        else rgb.resize((int(stored[1]), int(stored[0])), Image.BILINEAR)
    )
    evaluation = rgb.resize((image_size, image_size), Image.BILINEAR)
    return np.asarray(small), np.asarray(evaluation)


def decode_draft(path: str, shape) -> np.ndarray:
    """uint8 [h, w, 3] of ``shape`` (h, w): reduced-size JPEG decoding (``draft``) to at
    least ``shape``, then PIL's bilinear resize to exactly ``shape``."""
    h, w = int(shape[0]), int(shape[1])
    try:
        with Image.open(path) as image:
            image.draft("RGB", (w, h))
            rgb = image.convert("RGB")
    except Exception as e:  # PIL raises many types
        raise BadImageError(f"{path}: does not decode ({type(e).__name__}: {e})")
    if rgb.size != (w, h):
        rgb = rgb.resize((w, h), Image.BILINEAR)
    return np.asarray(rgb)


# ---- serving decoded images --------------------------------------------------------
def check_ids(ids, n: int) -> np.ndarray:
    """``ids`` as a 1-D intp array of flat ids in [0, n); ValueError or IndexError if not."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise IndexError(f"ids must be in [0, {n}), got min {ids.min()}, max {ids.max()}")
    return ids.astype(np.intp)


def place(canvas: np.ndarray, image: np.ndarray) -> None:
    """Image at the top-left of one canvas row, zeros elsewhere."""
    h, w = image.shape[:2]
    canvas[:h, :w] = image
    canvas[h:] = 0
    canvas[:h, w:] = 0
