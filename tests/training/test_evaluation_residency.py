"""sagm_jax.training.evaluation's residency: evaluation inputs are read from the source once per
run and kept where the budgets allow (accelerator, host memory, or read again), with the
same results in every case; and the evaluation batch's throughput default."""

import os
import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from sagm_jax import data as data_lib
from sagm_jax.training import evaluation
from sagm_jax.data.pipeline import eval_blocks
from sagm_jax.training.evaluation import DEVICE, HOST, Evaluator
from test_evaluation import Linear, digits_config

GiB = 2**30


def counting_evaluator(config, budgets=None, monkeypatch=None):
    """An evaluator on RotatedDigits whose source counts the rows it is asked for."""
    dataset = data_lib.from_config(config)
    read = []
    source = dataset.source
    original = source.eval_batches

    def eval_batches(ids, mask, position, **kwargs):
        for batch in original(ids, mask, position, **kwargs):
            read.append(len(batch["label"]))
            yield batch

    source.eval_batches = eval_batches
    if budgets is not None:
        monkeypatch.setattr(evaluation, "residency_budgets", lambda config, device: dict(budgets))
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    evaluator = Evaluator(Linear(), dataset, mesh, config, train_envs=[1, 2, 3, 4, 5])
    params = Linear().init(jax.random.key(0), np.zeros((1, 28, 28, 1), np.float32))["params"]
    return evaluator, read, types.SimpleNamespace(params=params, batch_stats={})


def padded_rows(evaluator) -> int:
    """Rows (padding included) of every evaluated part in the evaluation layout
    (``pipeline.eval_blocks``, tested in tests/data; 8: the fake devices)."""
    return sum(
        position.size
        for env, part in evaluator.parts
        for position, _ in eval_blocks(
            len(evaluator.dataset.splits[env][part]), evaluator.batch_size, multiple=8
        )
    )


@pytest.mark.parametrize("eval_splits", ["fast", "all"])
def test_a_second_evaluation_reads_nothing_from_the_source(eval_splits):
    evaluator, read, state = counting_evaluator(digits_config(eval_splits=eval_splits))
    first = evaluator(state)
    assert sum(read) == padded_rows(evaluator) > 0
    read.clear()
    second = evaluator(state)
    assert read == [] and second == first
    assert evaluator.kept_bytes[DEVICE] > 0 and evaluator.kept_bytes[HOST] == 0


@pytest.mark.parametrize(
    "budgets,reads_again",
    [
        ({DEVICE: 0, HOST: GiB}, False),  # all in host memory
        ({DEVICE: 0, HOST: 0}, True),  # nothing fits: read at every evaluation
        ({DEVICE: 450_000, HOST: 0}, True),  # some parts fit the device, the rest stream
    ],
)
def test_every_place_gives_the_same_results(monkeypatch, budgets, reads_again):
    config = digits_config()
    reference, _, state = counting_evaluator(config)
    expected = reference(state)
    evaluator, read, _ = counting_evaluator(config, budgets, monkeypatch)
    assert evaluator(state) == expected
    rows_first = sum(read)
    read.clear()
    assert evaluator(state) == expected
    assert (sum(read) > 0) == reads_again and sum(read) < rows_first + 1
    kept = evaluator.kept_bytes
    assert kept[DEVICE] <= budgets[DEVICE] and kept[HOST] <= budgets[HOST]
    if budgets[DEVICE] == 450_000:  # a part is kept whole or not at all
        image_bytes = 28 * 28 * 4 + 4 + 1  # float32 image, int32 label, bool mask per row
        assert 0 < kept[DEVICE] and kept[DEVICE] % image_bytes == 0
        assert sum(read) == padded_rows(evaluator) - kept[DEVICE] // image_bytes


def test_the_budgets_come_from_the_config_and_the_free_memory(monkeypatch):
    monkeypatch.setattr(evaluation, "available_host_bytes", lambda: 64 * GiB)
    config = types.SimpleNamespace(eval_cache_gb=40.0)
    gpu = types.SimpleNamespace(
        platform="gpu", memory_stats=lambda: {"bytes_limit": 80 * GiB, "bytes_in_use": 10 * GiB}
    )
    assert evaluation.residency_budgets(config, gpu) == {DEVICE: 35 * GiB, HOST: 32 * GiB}
    config.eval_cache_gb = 2.0
    assert evaluation.residency_budgets(config, gpu) == {DEVICE: 2 * GiB, HOST: 32 * GiB}
    cpu = types.SimpleNamespace(platform="cpu", memory_stats=lambda: None)
    assert evaluation.residency_budgets(config, cpu) == {DEVICE: 2 * GiB, HOST: 0}
    config.eval_cache_gb = 40.0
    assert evaluation.residency_budgets(config, cpu) == {DEVICE: 32 * GiB, HOST: 0}


def test_the_evaluation_batch_default_is_per_device_and_platform():
    config = types.SimpleNamespace(eval_batch_size=0)
    assert evaluation.batch_size(config, 8, "cpu") == 1024
    assert evaluation.batch_size(config, 1, "gpu") == 512
    assert evaluation.batch_size(config, 4, "tpu") == 2048
    config.eval_batch_size = 96
    assert evaluation.batch_size(config, 8, "gpu") == 96


def test_a_streamed_image_folder_is_decoded_at_the_first_evaluation_only(tmp_path, monkeypatch):
    """Streaming (a dataset too big to store) decodes every evaluation image at the first
    evaluation and never again in the run: the counted decoder is PIL's, decode_draft."""
    from sagm_jax import cli
    from sagm_jax.data import streaming

    from PIL import Image

    rng = np.random.default_rng(0)
    for domain in ("d0", "d1", "d2"):
        for cls in ("a", "b"):
            folder = tmp_path / "tree" / domain / cls
            folder.mkdir(parents=True)
            for k in range(6):
                pixels = rng.integers(0, 256, (40 + 8 * k, 30, 3), np.uint8)
                Image.fromarray(pixels).save(folder / f"{k}.jpg")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = cli.load_config_file(os.path.join(repo, "configs", "image_folder.py"))
    config.update(
        data_dir=str(tmp_path / "tree"),
        image_store="stream",
        image_size=16,
        cache_dir=str(tmp_path / "cache"),
        test_envs=(0,),
        eval_batch_size=8,
    )
    decoded = []
    decode = streaming.decode_draft

    def counted(path, shape):
        decoded.append(path)
        return decode(path, shape)

    monkeypatch.setattr(streaming, "decode_draft", counted)
    dataset = data_lib.from_config(config)
    assert isinstance(dataset.source.images, streaming.StreamingSource)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    evaluator = Evaluator(Linear(), dataset, mesh, config, train_envs=[1, 2])
    params = Linear().init(jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32))["params"]
    state = types.SimpleNamespace(params=params, batch_stats={})
    first = evaluator(state)
    examples = sum(len(dataset.splits[e][p]) for e, p in evaluator.parts)
    assert len(decoded) == padded_rows(evaluator) >= examples > 0
    decoded.clear()
    assert evaluator(state) == first and decoded == []
