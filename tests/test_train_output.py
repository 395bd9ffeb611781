"""What sagm_jax.train prints and writes around runs: the summary in percent, the
all_test_envs table (printed and written to results.md), the run directory and the
wall time. No training: ``run`` is replaced."""

import os
import types

from sagm_jax import train
from sagm_jax.config import mnist_config


def record(step, accs, test_env):
    r = {"step": step}
    for env, acc in enumerate(accs):
        r[f"env{env}_in_acc"] = acc
        r[f"env{env}_out_acc"] = acc if env != test_env else 0.0
    return r


def test_summary_is_in_percent_with_the_selected_step(capsys):
    records = [record(0, [0.1, 0.5, 0.5], 0), record(10, [0.25, 0.8, 0.9], 0)]
    train.print_summary(records, [0], ["art", "photo", "sketch"])
    out = capsys.readouterr().out
    assert "Selected step 10 by training-domain validation" in out and "85.0%" in out
    assert "env0 art (test)" in out and "25.0" in out and "90.0" in out
    assert "Test accuracy ('in' split of the test environment): env0 art 25.0%" in out


def test_all_test_envs_prints_and_writes_the_table_then_workdir_and_wall_time(
    tmp_path, capsys, monkeypatch
):
    names = ["art", "photo", "sketch"]
    monkeypatch.setattr(
        train.data_lib, "from_config", lambda config, **_: types.SimpleNamespace(env_names=names)
    )

    def fake_run(config, workdir):
        (env,) = config.test_envs
        return [record(0, [0.5 + 0.1 * env] * 3, env)]

    monkeypatch.setattr(train, "run", fake_run)
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
    assert f"Run directory: {tmp_path / 'run'}" in out.splitlines()[-2]
    assert out.splitlines()[-1].startswith("Wall time: 0m0")
