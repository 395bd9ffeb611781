"""Decoding one original file to the stored size (``sagm_jax.data.decode``): the stored-shape
rule. Its pixels are checked through the stores that keep them (``test_store.py``,
``test_jpeg_store.py``) and streaming (``test_store.py``)."""

import numpy as np

from sagm_jax.data import decode


def test_stored_shape_rule():
    assert decode.stored_shape(227, 227, 320) == (227, 227)  # PACS: kept
    assert decode.stored_shape(320, 1000, 320) == (320, 1000)
    assert decode.stored_shape(480, 640, 320) == (320, 427)  # 426.67 rounds to 427
    assert decode.stored_shape(1536, 2048, 320) == (320, 427)  # TerraIncognita
    assert decode.stored_shape(500, 375, 320) == (427, 320)
    assert decode.stored_shape(2, 3, 1) == (1, 2)  # 1.5: halves round up
    # Every crop RandomResizedCrop(scale=(0.7, 1), ratio=(3/4, 4/3)) can draw from a stored
    # image (shorter side 320) is >= 224 px on both sides: the smallest is min area, extreme
    # aspect, on a square image.
    for long_side in (320, 427, 480, 1000):
        area = 0.7 * 320 * long_side
        for ratio in (3 / 4, 4 / 3):
            crop_w, crop_h = round(np.sqrt(area * ratio)), round(np.sqrt(area / ratio))
            assert min(crop_w, crop_h) >= 224, (long_side, ratio, crop_w, crop_h)
