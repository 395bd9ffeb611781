"""sagm_jax.training.train and sagm_jax.main: runs end to end (records, run directory, resume,
devices), and what the program prints and writes around its runs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from PIL import Image

from sagm_jax import models
from sagm_jax.training import loading
from sagm_jax.training import rundir
from sagm_jax.training import train
from sagm_jax.config import base_config, mnist_config
from sagm_jax.models import synthetic
from sagm_jax.training.checkpoints import DamagedCheckpointError

from run_fixtures import digits_config, tiny_folder_config, write_image_tree
from test_checkpoints import damage
from test_summary import summary_record

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tests that train real runs are marked slow: left out of `pytest -m "not slow"`.


def restore_params(workdir, which="latest"):
    return loading.load_run(str(workdir), which)[1]["params"]


@pytest.mark.slow
def test_rotated_digits_end_to_end(tmp_path):
    # On the eight fake devices: the batch and the evaluation sharded.
    records = train.train_and_evaluate(digits_config(num_devices=0), str(tmp_path))
    assert [r["step"] for r in records] == [0, 2, 4]
    on_disk = train.read_records(str(tmp_path))
    assert [r["step"] for r in on_disk] == [0, 2, 4]
    for record in on_disk:
        assert np.isfinite(record["loss"])
        # The default eval_splits="fast": every 'out' part and the test environment's
        # 'in', not the training environments' 'in' (tests/training/test_evaluation.py: "all").
        assert record["config"]["eval_splits"] == "fast"
        accuracies = {k for k in record if k.endswith("_acc")}
        assert accuracies == {"env0_in_acc", *(f"env{e}_out_acc" for e in range(6))}
        assert all(0.0 <= record[k] <= 1.0 for k in accuracies)
        assert record["args"]["test_envs"] == [0] and record["hparams"]["lr"] == 1e-3
    for name in ("config.json", "run_info.json", "split.json", "done"):
        assert os.path.exists(tmp_path / name), name
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path))
    # Checkpoints are named by record steps: the latest (4) and the selected one.
    best = loading.load_run(str(tmp_path), "best")[2]["step"]
    assert sorted(map(int, os.listdir(tmp_path / "checkpoints"))) == sorted({best, 4})
    # A finished run is not trained again.
    again = train.train_and_evaluate(digits_config(num_devices=0), str(tmp_path))
    assert [r["step"] for r in again] == [0, 2, 4]
    assert len(train.read_records(str(tmp_path))) == 3


@pytest.mark.slow
def test_image_folder_with_pretrained_resnet18(tmp_path):
    write_image_tree(tmp_path / "data")
    weights = synthetic.draw_torchvision_weights("resnet18", seed=0)
    weights_file = str(tmp_path / "resnet18.safetensors")
    models.save_weights(weights, weights_file)
    config = tiny_folder_config(
        tmp_path,
        arch="resnet18",
        pretrained_weights=weights_file,
        image_size=32,
        steps=2,
        eval_every=1,
        test_envs=(1,),
        lr=1e-4,
        algorithm=base_config().algorithm,
        num_devices=1,  # what it checks does not depend on the devices; compiles faster
    )
    records = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert [r["step"] for r in records] == [0, 1]
    with open(tmp_path / "run" / "run_info.json") as f:
        info = json.load(f)
    assert info["weights"]["sha256"] == models.file_sha256(weights_file)
    assert info["test_envs"] == [1] and info["train_envs"] == [0, 2]
    # The backbone started from the file: the first conv moved by at most a few lr steps.
    conv1 = np.asarray(restore_params(tmp_path / "run")["conv1"]["kernel"])
    np.testing.assert_allclose(conv1, weights["conv1.weight"].transpose(2, 3, 1, 0), atol=1e-3)


@pytest.mark.slow
def test_all_test_envs_runs_each_environment(tmp_path, capsys):
    write_image_tree(tmp_path / "data", domains=("art", "photo"), n=3)
    config = tiny_folder_config(tmp_path, steps=1, all_test_envs=True, num_devices=4)
    table = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert sorted(table) == [0, 1]
    for env in range(2):
        assert os.path.exists(tmp_path / "run" / f"test_env{env}" / "done")
    assert "test accuracy (training-domain validation)" in capsys.readouterr().out


@pytest.mark.slow
def test_per_device_perturbation_runs_and_differs_from_global(tmp_path):
    per_device = train.train_and_evaluate(
        digits_config(steps=2, eval_every=1, perturbation="per_device", num_devices=0),
        str(tmp_path / "per_device"),
    )
    global_ = train.train_and_evaluate(
        digits_config(steps=2, eval_every=1, num_devices=0), str(tmp_path / "global")
    )
    assert per_device[0]["loss"] == pytest.approx(global_[0]["loss"], rel=1e-5)  # same clean pass
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(restore_params(tmp_path / "per_device")),
            jax.tree.leaves(restore_params(tmp_path / "global")),
        )
    )
    assert gap > 0


def _main_command(workdir, *overrides):
    return [
        sys.executable,
        "-m",
        "sagm_jax.main",
        f"--config={REPO}/configs/rotated_digits.py",
        f"--workdir={workdir}",
        "--config.steps=16",
        "--config.eval_every=3",
        "--config.batch_per_env=4",
        "--config.eval_batch_size=64",
        "--config.cnn_widths=16,32,32,32",
        *overrides,
    ]


def _run_env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = ""  # one CPU device, as a user's laptop
    return env


# ``python -m sagm_jax.main`` on a machine without TensorFlow, as many GPU machines are:
# its import is made to fail.
WITHOUT_TENSORFLOW = (
    "import sys, runpy; sys.modules['tensorflow'] = None; "
    "sys.modules['tensorflow_datasets'] = None; sys.argv = ['sagm_jax.main'] + sys.argv[1:]; "
    "runpy.run_module('sagm_jax.main', run_name='__main__', alter_sys=True); "
    "assert sys.modules['tensorflow'] is None"
)


def _without_tensorflow(command):
    return [sys.executable, "-c", WITHOUT_TENSORFLOW, *command[3:]]


def _folder_overrides(tmp_path):
    """A tiny image folder trained through the device input path (decoded store,
    augmentation on the device)."""
    write_image_tree(tmp_path / "data", n=4)
    return [
        "--config.dataset=ImageFolder",
        f"--config.data_dir={tmp_path / 'data'}",
        f"--config.cache_dir={tmp_path / 'cache'}",
        "--config.input=device",
        "--config.image_size=16",
        "--config.test_envs=1",
    ]


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    """A run killed with SIGKILL and relaunched gives the uninterrupted run's records and
    weights bit for bit: an image folder through the device input (store, device
    augmentation, evaluation, checkpoints) on a machine without TensorFlow. (SWAD's
    averages and valley resume too: tests/methods/test_method_runs.py.)"""
    command = lambda *args: _without_tensorflow(_main_command(*args))  # noqa: E731
    overrides = _folder_overrides(tmp_path)
    # The uninterrupted run first: the run to kill then finds its programs in the session's
    # compilation cache (run side by side, both compiled them, at 16 s of CPU each).
    whole_run = subprocess.run(
        command(tmp_path / "whole", *overrides), env=_run_env(), cwd=REPO, capture_output=True,
        text=True, timeout=600,
    )
    assert whole_run.returncode == 0, whole_run.stderr[-3000:]
    assert "TensorFlow is not installed" in whole_run.stdout
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        command(killed, *overrides),
        env=_run_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while len(train.read_records(str(killed))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    records_at_kill = len(train.read_records(str(killed)))
    assert not os.path.exists(killed / "done") and 3 <= records_at_kill < 6
    resumed = subprocess.run(
        command(killed, *overrides),
        check=True, env=_run_env(), cwd=REPO, capture_output=True, text=True
    )
    assert "resumed at step" in resumed.stdout
    with open(tmp_path / "whole" / "results.jsonl") as a, open(killed / "results.jsonl") as b:
        whole, again = a.read(), b.read()
    assert whole.replace(str(tmp_path / "whole"), "W") == again.replace(str(killed), "W")
    for a, b in zip(
        jax.tree.leaves(restore_params(tmp_path / "whole")), jax.tree.leaves(restore_params(killed))
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    config = digits_config(lr=1e30, steps=40, eval_every=1)
    with pytest.raises(FloatingPointError, match="Non-finite.*last good checkpoint"):
        train.train_and_evaluate(config, str(tmp_path))
    params = restore_params(tmp_path)
    assert all(np.all(np.isfinite(np.asarray(p))) for p in jax.tree.leaves(params))
    assert not os.path.exists(tmp_path / "done")


@pytest.mark.slow
def test_a_workdir_with_another_config_is_refused(tmp_path):
    train.train_and_evaluate(digits_config(steps=1), str(tmp_path))
    os.remove(tmp_path / "done")
    with pytest.raises(ValueError, match=r"different config \(keys \['lr'\]"):
        train.train_and_evaluate(digits_config(steps=1, lr=0.5), str(tmp_path))


@pytest.mark.slow
def test_a_relaunch_that_changes_eval_splits_is_refused(tmp_path, capsys):
    """A run's records all hold the parts of one eval_splits: a finished fast run
    relaunched with "all" is refused, naming the key and the value that goes on."""
    train.train_and_evaluate(digits_config(steps=1), str(tmp_path))
    before = (tmp_path / "results.jsonl").read_text()
    capsys.readouterr()
    with pytest.raises(
        ValueError, match=r"keys \['eval_splits'\] differ.*relaunch with --config.eval_splits=fast"
    ):
        train.train_and_evaluate(digits_config(steps=1, eval_splits="all"), str(tmp_path))
    assert "Selected step" not in capsys.readouterr().out
    assert (tmp_path / "results.jsonl").read_text() == before


@pytest.mark.slow
def test_batch_that_does_not_divide_among_devices_is_named(tmp_path):
    with pytest.raises(ValueError, match="config.batch_per_env.*= 15 does not divide among 8"):
        train.train_and_evaluate(digits_config(batch_per_env=3, num_devices=0),
                                 str(tmp_path / "run"))
    # Nothing was written, so following the error's advice in the same workdir works.
    assert not os.path.exists(tmp_path / "run")
    records = train.train_and_evaluate(digits_config(steps=1, num_devices=0),
                                       str(tmp_path / "run"))
    assert [r["step"] for r in records] == [0]


@pytest.mark.slow
def test_a_finished_run_relaunched_with_another_config_is_refused(tmp_path, capsys):
    """Relaunching a done run with other test_envs must not print its old results
    under the new labels (a training environment shown as the test one)."""
    train.train_and_evaluate(digits_config(steps=1), str(tmp_path))
    assert os.path.exists(tmp_path / "done")
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"different config \(keys \['test_envs'\]"):
        train.train_and_evaluate(digits_config(steps=1, test_envs=(1,)), str(tmp_path))
    assert "Selected step" not in capsys.readouterr().out


@pytest.mark.slow
def test_an_empty_split_part_is_refused_before_anything_is_written(tmp_path):
    """Two images per domain leave the 'out' parts empty (2 x 0.2 rounds to 0): their
    accuracy would be NaN, which no checkpoint comparison can rank."""
    write_image_tree(tmp_path / "data", classes=("cat",), n=2)
    config = base_config()
    config.update(
        dataset="ImageFolder",
        data_dir=str(tmp_path / "data"),
        arch="mnist_cnn",
        cache_dir=str(tmp_path / "cache"),
        image_size=16,
        batch_per_env=8,
        test_envs=(1,),
    )
    with pytest.raises(ValueError, match=r"Empty split parts: env0 \(art\) 'out'.*holdout_fraction"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_test_envs_out_of_range_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"config.test_envs=\(7,\).*0..5"):
        train.train_and_evaluate(digits_config(test_envs=(7,)), str(tmp_path))


def _two_processes(workdir, overrides, port):
    return [
        subprocess.Popen(
            _main_command(
                workdir,
                *overrides,
                "--distributed",
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ),
            env=_run_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


@pytest.mark.slow
def test_two_processes_killed_and_resumed_give_the_two_device_run(tmp_path):
    """Multi-host through jax.distributed: two local CPU processes (gloo collectives),
    one device each, killed after a few evaluations and relaunched, against one process
    with two devices. After the restore every process must take the same checkpoint
    decisions (a save entered by one process alone hangs in orbax's barrier)."""
    overrides = ["--config.steps=5", "--config.eval_every=1"]
    env = _run_env()
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    # The two-device run and the two processes to kill run side by side (the test's time).
    single_err = open(tmp_path / "single.err", "w")
    single_run = subprocess.Popen(
        _main_command(tmp_path / "single", *overrides), env=env, cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=single_err,
    )
    port = 20000 + os.getpid() % 20000
    workers = _two_processes(tmp_path / "multi", overrides, port)
    deadline = time.time() + 300
    while len(train.read_records(str(tmp_path / "multi"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    for w in workers:
        w.send_signal(signal.SIGKILL)
        w.wait()
    assert 3 <= len(train.read_records(str(tmp_path / "multi"))) < 5
    workers = _two_processes(tmp_path / "multi", overrides, port + 1)
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [o[-3000:] for o in outputs]
    assert all("resumed at step" in o for o in outputs)
    single_run.wait(timeout=600)
    single_err.close()
    assert single_run.returncode == 0, (tmp_path / "single.err").read_text()[-3000:]
    single = train.read_records(str(tmp_path / "single"))
    multi = train.read_records(str(tmp_path / "multi"))
    assert [r["step"] for r in multi] == list(range(5))
    for a, b in zip(single, multi):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        for key in a:
            if key.endswith("_acc"):
                assert a[key] == pytest.approx(b[key], abs=1.0 / 60), key


@pytest.mark.slow
def test_a_failed_start_leaves_no_workdir_behind(tmp_path):
    """The command line claims its workdir (run.lock) before the run checks what only the
    data can tell; when such a check fails, the new directory is removed again."""
    for domain in ("a", "b"):  # lists well (checked before), does not decode (the loader's)
        (tmp_path / "data" / domain / "x").mkdir(parents=True)
        (tmp_path / "data" / domain / "x" / "0.png").write_text("not a PNG")
    failed = subprocess.run(
        _main_command(
            tmp_path / "run",
            "--config.dataset=ImageFolder",
            f"--config.data_dir={tmp_path / 'data'}",
            f"--config.cache_dir={tmp_path / 'cache'}",
        ),
        env=_run_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1 and "do not decode" in failed.stderr, failed.stderr
    assert not os.path.exists(tmp_path / "run")


# What the program prints and writes around runs, without training (fast).


def test_all_test_envs_prints_the_workdir_once_then_writes_the_table_and_wall_time(
    tmp_path, capsys, monkeypatch
):
    names = ["art", "photo", "sketch"]
    monkeypatch.setattr(
        train.data_lib, "from_config", lambda config, **_: types.SimpleNamespace(env_names=names)
    )

    def fake_train_one_run(config, workdir):
        (env,) = config.test_envs
        return [summary_record(0, [0.5 + 0.1 * env] * 3, env)]

    monkeypatch.setattr(train, "train_one_run", fake_train_one_run)
    config = mnist_config("ImageFolder")
    config.all_test_envs, config.algorithm = True, "erm"
    os.makedirs(tmp_path / "run")
    table = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert table == {0: 0.5, 1: 0.6, 2: 0.7}
    written = (tmp_path / "run" / "results.md").read_text()
    assert "| test environment | art | photo | sketch | Avg |" in written
    assert "| accuracy | 50.0 | 60.0 | 70.0 | 60.0 |" in written
    out = capsys.readouterr().out
    assert written.strip() in out
    assert out.splitlines()[0] == f"Run directory: {tmp_path / 'run'}"
    assert out.count("Run directory:") == 1
    assert out.splitlines()[-1].startswith("Wall time: 0m0")



def test_a_relaunched_finished_run_prints_its_recorded_wall_time(tmp_path, capsys, monkeypatch):
    """The relaunch trains nothing: it prints the wall time the finishing launch recorded
    (a run directory written before runs recorded it prints this launch's time)."""
    monkeypatch.setattr(train, "train_one_run", lambda config, workdir: [])
    config = mnist_config("RotatedDigits")
    run = tmp_path / "run"
    os.makedirs(run)
    rundir.RunDir(str(run), is_main=True).mark_done(wall_time_s=28.4)
    assert rundir.read_wall_time(str(run)) == 28.4
    train.train_and_evaluate(config, str(run))
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("Wall time: 0m28s (0m28s recorded when it trained, 0m0"), last
    os.remove(run / rundir.WALL_TIME)  # a run finished before wall times were recorded
    train.train_and_evaluate(config, str(run))
    assert capsys.readouterr().out.splitlines()[-1].startswith("Wall time: 0m0")


# --- a run's data and records are checked when it resumes or is relaunched done -----------


def resumable_folder_config(tmp_path):
    """A tiny image-folder run on the device input path: evaluations after steps 0, 2, 4."""
    return tiny_folder_config(
        tmp_path,
        cache_dir=str(tmp_path / "cache"),
        input="device",
        steps=5,
        eval_every=2,
        test_envs=(1,),
    )


class _Stopped(Exception):
    pass


def stop_after_checkpoint(monkeypatch, step):
    """The next run stops right after saving the checkpoint of ``step``, as a kill would."""
    save = train.Checkpoints.save

    def save_then_stop(self, t, state, validation, training=None):
        save(self, t, state, validation, training)
        if t == step:
            raise _Stopped

    monkeypatch.setattr(train.Checkpoints, "save", save_then_stop)


def _file_bytes(folder):
    return {n: (folder / n).read_bytes() for n in ("split.json", "results.jsonl")}


@pytest.mark.slow
def test_a_dataset_changed_under_a_run_is_refused_on_resume_and_when_done(tmp_path, monkeypatch):
    write_image_tree(tmp_path / "data")  # art has 8 images, 4 per class
    run = tmp_path / "run"
    with monkeypatch.context() as patched:
        stop_after_checkpoint(patched, 2)
        with pytest.raises(_Stopped):
            train.train_one_run(resumable_folder_config(tmp_path), str(run))
    before = _file_bytes(run)
    extra = tmp_path / "data" / "art" / "cat" / "extra.jpg"
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(extra)
    with pytest.raises(ValueError, match=r"split.json.*environment `art`: 8 -> 9 images") as e:
        train.train_one_run(resumable_folder_config(tmp_path), str(run))
    assert "'in'" in str(e.value) and "--workdir" in str(e.value)
    assert _file_bytes(run) == before  # split.json never rewritten, no record added
    # Restoring the data, as the message says, resumes the run.
    os.remove(extra)
    records = train.train_one_run(resumable_folder_config(tmp_path), str(run))
    assert [r["step"] for r in records] == [0, 2, 4]
    # A finished run relaunched on changed data.
    os.remove(tmp_path / "data" / "art" / "dog" / "0.jpg")
    changed = r"environment `art`: 8 -> 7 images \(class `dog`: 4 -> 3\)"
    with pytest.raises(ValueError, match=changed):
        train.train_one_run(resumable_folder_config(tmp_path), str(run))


@pytest.mark.slow
def test_a_lost_or_repeated_record_is_refused_on_resume_and_when_done(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as patched:
        stop_after_checkpoint(patched, 2)
        with pytest.raises(_Stopped):
            train.train_one_run(digits_config(), str(run))
    results = run / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [0, 2]
    results.write_text(lines[1])  # `sed -i 1d`: the record of step 0 lost (the one of 2,
    # the restored checkpoint's, would be made again from it)
    with pytest.raises(rundir.RecordsError, match=r"results.jsonl: missing step\(s\) \[0\]"):
        train.train_one_run(digits_config(), str(run))
    results.write_text("".join(lines))
    train.train_one_run(digits_config(), str(run))
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join(lines[:2] + lines[1:]))  # step 2 duplicated
    with pytest.raises(rundir.RecordsError, match=r"results.jsonl: repeated step\(s\) \[2\]"):
        train.train_one_run(digits_config(), str(run))
    results.write_text("".join(lines[:1] + lines[2:]))  # step 2 lost, in a finished run
    with pytest.raises(rundir.RecordsError, match=r"missing step\(s\) \[2\]"):
        train.train_one_run(digits_config(), str(run))
    # The last one lost is made again from its checkpoint (test_a_torn_last_record_...).


# --- damaged checkpoints and a lost last record, against the uninterrupted run ------------


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """An uninterrupted run (digits_config: evaluations after steps 0, 2, 4), which keeps
    checkpoints 2 (the best) and 4 (the latest). Tests change copies of it."""
    workdir = tmp_path_factory.mktemp("whole")
    train.train_one_run(digits_config(), str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return workdir


def copy_run(run, workdir, finished=True):
    shutil.copytree(run, workdir)
    if not finished:
        os.remove(workdir / "done")
    return workdir


def assert_same_run(whole, run):
    """The same results.jsonl (but for the run directory each record names: ``run``'s
    records before the relaunch were copied from ``whole``) and, bit for bit, the same
    parameters of the latest checkpoint."""
    def records(folder):
        text = (folder / "results.jsonl").read_text()
        return text.replace(str(whole), "RUN").replace(str(run), "RUN")

    assert records(run) == records(whole)
    for a, b in zip(jax.tree.leaves(restore_params(whole)), jax.tree.leaves(restore_params(run))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_run_ends_as_the_uninterrupted_one(
    whole_run, tmp_path, capsys
):
    """Checkpoint 4 truncated before the run that saved it could finish: ``load_run``
    names it and the step that reads; the relaunch resumes from 2, trains 3 and 4 again
    and ends as the uninterrupted run, with one warning line."""
    run = copy_run(whole_run, tmp_path / "run", finished=False)
    damage(run, 4)
    damaged = r"step 4 is damaged and cannot be read \(.*\)\. The steps that read: \[2\]\."
    with pytest.raises(DamagedCheckpointError, match=damaged):
        loading.load_run(str(run), "latest")
    capsys.readouterr()
    records = train.train_one_run(digits_config(), str(run))
    assert [r["step"] for r in records] == [0, 2, 4]
    assert_same_run(whole_run, run)
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4", "4.damaged"]
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "4.damaged" in line] == [
        line for line in err.splitlines() if line.startswith("Warning:")
    ]
    assert err.count("Warning:") == 1 and "Resuming from step 2" in err


@pytest.mark.slow
@pytest.mark.parametrize("finished", [True, False])
def test_a_torn_last_record_is_made_again_from_its_checkpoint(
    whole_run, tmp_path, capsys, finished
):
    """The last line of results.jsonl torn, in a finished run or one stopped after its
    last checkpoint: the relaunch evaluates checkpoint 4 again and writes the record the
    uninterrupted run wrote."""
    run = copy_run(whole_run, tmp_path / "run", finished=finished)
    results = run / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join(lines[:-1]) + lines[-1][:100])
    records = train.train_one_run(digits_config(), str(run))
    assert_same_run(whole_run, run)
    assert json.loads(json.dumps(records)) == train.read_records(str(run))  # tuples: lists
    assert f"made again from {run / 'checkpoints' / '4'}" in capsys.readouterr().err
