"""Streaming decode: an image folder served by decoding its original files on every call.

Owns ``StreamingSource``, for datasets too big for either store (``store.py``, ``jpeg_store.py``;
``canvas.open_source`` chooses): the stores' interface (``gather``, ``eval_images``, ``len``,
``close``), decoding in a thread pool (PIL releases the GIL while decoding). It uses PIL's
``draft("RGB", (w, h))`` (``decode.decode_draft``): JPEGs are decoded with libjpeg's scaled
IDCT at 1/2, 1/4 or 1/8 of full size when that is still at least the wanted size, then
resized exactly to the stored shape (or S x S). Its pixels equal the decoded store's when no
reduction applies (non-JPEG files, and JPEGs less than twice the wanted size: PACS, and
640x480 to 320x427); when one does, the DCT-domain reduction (about a box average) stands in
for part of PIL's antialiased bilinear shrink, so pixels differ. Measured: a 2048x1536
photo-like JPEG to 320x427 (1/4 draft) differs by 0.5 levels on average, 3 at most (its
224x224 eval image 0.3, 2); the worst case, a fine texture reduced exactly 2x, by 3.1 on
average, 36 at most (``tests/data/test_store.py``,
``test_streaming_matches_store``). No TensorFlow here.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from sagm_jax.data.decode import check_ids, cpu_count, decode_draft, place, stored_shapes


class StreamingSource:
    """``store.ImageStore``'s interface, decoding on every call with ``draft`` (module doc), in
    a thread pool (PIL releases the GIL while decoding)."""

    def __init__(
        self,
        paths,
        sizes,
        *,
        image_size: int = 224,
        short_side: int = 320,
        threads: int | None = None,
    ):
        self.paths = list(paths)
        self.shapes = stored_shapes(np.asarray(sizes), short_side)  # int32 [N, 2]
        self.canvas = tuple(int(x) for x in self.shapes.max(axis=0))
        self.image_size = int(image_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads or cpu_count())

    def __len__(self) -> int:
        return len(self.paths)

    def close(self) -> None:
        self._pool.shutdown()

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As ``store.ImageStore.gather``."""
        ids = check_ids(ids, len(self))
        out = np.empty((len(ids), *self.canvas, 3), np.uint8)

        def one(k):
            i = ids[k]
            place(out[k], decode_draft(self.paths[i], self.shapes[i]))

        list(self._pool.map(one, range(len(ids))))
        return out, self.shapes[ids]

    def eval_images(self, ids: np.ndarray) -> np.ndarray:
        """As ``store.ImageStore.eval_images`` (reduced-size decoding to at least S x S first)."""
        ids = check_ids(ids, len(self))
        s = self.image_size
        out = np.empty((len(ids), s, s, 3), np.uint8)

        def one(k):
            out[k] = decode_draft(self.paths[ids[k]], (s, s))

        list(self._pool.map(one, range(len(ids))))
        return out
