"""sagm_jax.cli and the command line of sagm_jax.main: help, everything missing at once,
user errors without traceback, one run per workdir, and Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from run_fixtures import image_folder

from sagm_jax import claims, cli
from sagm_jax.config import all_fields, base_config, config_problems, mnist_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join("configs", "rotated_digits.py")


def main(*args, timeout=300, **kwargs):
    """``python -m sagm_jax.main ARGS`` from the repository root, on one CPU device."""
    env = {**os.environ, "XLA_FLAGS": ""}
    return subprocess.run(
        [sys.executable, "-m", "sagm_jax.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
        **kwargs,
    )


def flat(text: str) -> str:
    """Messages wrap at 100 columns; compare their words."""
    return " ".join(text.split())


def test_help_exits_0_and_lists_every_field_with_its_value_and_meaning():
    result = main("--help", "--config=configs/pacs.py")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "--config.dataset=PACS" in out and "--config.lr=3e-05" in out  # the file's values
    for field in all_fields():
        assert f"--config.{field.key}=" in out
        assert field.meaning.split()[0] in out
    assert "--workdir=DIR" in out and "--traceback" in out


def test_the_bare_paper_command_lists_everything_missing_at_once():
    result = main("--config=configs/pacs.py")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    err = flat(result.stderr)
    assert "2 thing(s) to fix" in err
    assert "--config.data_dir=DATA_DIR is missing" in err and "DATA_DIR/PACS/<domain>" in err
    assert "python -m sagm_jax.data.verify --dataset=PACS --data_dir=DATA_DIR" in err
    assert err.count("--config.pretrained_weights=FILE is missing") == 1
    assert "https://download.pytorch.org/models/resnet50-0676ba61.pth" in err
    assert "Getting the data" in err and "ImageNet weights" in err
    assert "workdirs/PACS-sagm-test0-trial0-" in err  # where it would run
    assert (
        "python -m sagm_jax.main --config=configs/pacs.py --config.data_dir=DATA_DIR "
        "--config.pretrained_weights=resnet50-0676ba61.pth" in err
    )


@pytest.mark.parametrize(
    "args,message",
    [
        ((), "--config is missing"),
        (("--config=configs/nope.py",), "--config=configs/nope.py: no such file"),
        ((f"--config={DIGITS}", "--config.steps=abc"), "config.steps expects int values"),
    ],
)
def test_command_line_errors_are_one_message_and_exit_2(args, message):
    result = main(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith("python -m sagm_jax.main: ")


def test_an_unknown_override_lists_the_valid_keys():
    config = cli.load_config_file(os.path.join(REPO, DIGITS))
    args = ["--config=" + DIGITS, "--config.lr=0.1", "--config.test_envs", "1"]
    cli.check_overrides(args, config, DIGITS)
    with pytest.raises(cli.UsageError, match=f"--config.learning_rate: no such key in {DIGITS}"):
        cli.check_overrides([*args, "--config.learning_rate=0.1"], config, DIGITS)
    with pytest.raises(cli.UsageError) as error:
        cli.check_overrides(["--config.qqqq", "3"], config, DIGITS)
    valid = str(error.value).split("Valid keys: ", 1)[1].rstrip(".").split(", ")
    assert valid == sorted(config.keys())


def test_main_refuses_an_unknown_key_before_writing_anything(tmp_path):
    result = main(f"--config={DIGITS}", f"--workdir={tmp_path}", "--config.stepz=3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("python -m sagm_jax.main: --config.stepz: no such key")
    assert "steps" in result.stderr and not os.listdir(tmp_path)


def test_bad_values_and_an_unwritable_workdir_are_listed_together(tmp_path):
    (tmp_path / "file").write_text("")
    config = mnist_config("RotatedDigits")
    config.algorithm, config.dropout, config.test_envs = "adam", 2.0, ("x",)
    workdir = str(tmp_path / "file" / "run")
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, workdir, ["main", f"--workdir={workdir}"])
    message = flat(str(error.value))
    assert "4 thing(s) to fix" in message
    for part in (
        "config.algorithm=adam: expected one of erm",
        "config.dropout=2.0",
        "config.test_envs=('x',): expected environment indices",
        f"--workdir={workdir}: {tmp_path / 'file'} is a file",
    ):
        assert part in message
    config = mnist_config("RotatedDigits")
    cli.preflight(config, str(tmp_path / "run"), ["main"])  # nothing to fix


def test_missing_data_and_weights_files_are_named(tmp_path):
    config = base_config()
    config.update(dict(dataset="PACS", data_dir=str(tmp_path), pretrained_weights="w.pth"))
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), ["main"])
    message = flat(str(error.value))
    assert f"--config.data_dir={tmp_path}: it has no PACS/ folder" in message
    assert message.count("--config.pretrained_weights=w.pth: no such file") == 1
    data = image_folder(tmp_path / "folder")
    config.update(dict(dataset="ImageFolder", data_dir=data, pretrained_weights="none"))
    cli.preflight(config, str(tmp_path / "run"), ["main"])  # ImageFolder: data_dir itself


def test_default_workdir_names_the_run_and_changes_with_the_config():
    config = mnist_config("RotatedDigits")
    first = cli.default_workdir(config)
    assert first.startswith(os.path.join("workdirs", "RotatedDigits-sagm-test0-trial0-"))
    assert cli.default_workdir(mnist_config("RotatedDigits")) == first
    config.lr = 0.1
    assert cli.default_workdir(config) != first


def test_default_workdir_names_the_objective_and_swad_where_not_the_defaults():
    config = mnist_config("RotatedDigits")
    config.objective, config.swad = "coral", True
    name = os.path.basename(cli.default_workdir(config))
    assert name.startswith("RotatedDigits-sagm-coral-swad-test0-trial0-"), name
    config.swad = False
    assert os.path.basename(cli.default_workdir(config)).startswith(
        "RotatedDigits-sagm-coral-test0-"
    )


def test_a_stop_before_anything_was_written_says_so(tmp_path):
    """Ctrl-C or SIGTERM during the set-up (the data load): nothing to resume from."""
    workdir = str(tmp_path / "run")
    message = cli.interrupted_message(workdir, ["main", f"--config={DIGITS}"])
    assert "keeps its checkpoints and records" not in message
    assert (
        f"Stopped before the first evaluation: {workdir} holds no checkpoint or records" in message
    )
    assert f"python -m sagm_jax.main --config={DIGITS} --workdir={workdir}" in message
    os.makedirs(os.path.join(workdir, "checkpoints", "0"))  # one checkpoint: resumable
    assert "keeps its checkpoints and records" in cli.interrupted_message(workdir, ["main"])


def test_an_error_during_the_run_is_one_message(tmp_path):
    for domain in ("a", "b"):  # an image that does not decode: found by the run's loader
        (tmp_path / "data" / domain / "x").mkdir(parents=True)
        (tmp_path / "data" / domain / "x" / "0.png").write_text("not a PNG")
    result = main(
        f"--config={DIGITS}",
        f"--workdir={tmp_path / 'run'}",
        "--config.dataset=ImageFolder",
        f"--config.data_dir={tmp_path / 'data'}",
        f"--config.cache_dir={tmp_path / 'cache'}",
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "error:" in result.stderr
    assert "--traceback shows where" in result.stderr
    assert "--config.skip_bad_files=True" in result.stderr


OFFLINE = """
import runpy, socket, sys
from tensorflow_datasets.core.download import downloader

def getaddrinfo(*args, **kwargs):  # every host name fails, as without internet
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

socket.getaddrinfo = getaddrinfo
downloader.MAX_RETRIES = 0  # one try, not tfds's 10 retries with backoff (about 200 s)
sys.argv[0] = "sagm_jax.main"
runpy.run_module("sagm_jax.main", run_name="__main__")
"""


def test_rotated_mnist_without_internet_says_the_download_needs_it(tmp_path):
    """A fresh install gets as far as MNIST's download, and says what it needs."""
    data_dir = tmp_path / "tfds"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            OFFLINE,
            "--config=configs/rotated_mnist.py",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data_dir={data_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    err = flat(result.stderr)
    assert "Traceback" not in err and "No module named" not in err
    assert f"error: MNIST is not prepared in {data_dir}" in err
    assert "Downloading MNIST needs the internet" in err and "--config.data_dir=DIR" in err


def test_a_second_process_on_the_same_workdir_is_refused(tmp_path):
    workdir = str(tmp_path / "run")
    with claims.try_claim(workdir, "run.lock"):
        result = main(f"--config={DIGITS}", f"--workdir={workdir}")
    assert result.returncode == 2
    assert "another process is training this run" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tmp_path):
    workdir = tmp_path / "run"
    args = [
        f"--config={DIGITS}",
        f"--workdir={workdir}",
        "--config.steps=20",
        "--config.eval_every=5",
        "--config.batch_per_env=8",
        "--config.cnn_widths=16,32,32,32",
    ]
    env = {**os.environ, "XLA_FLAGS": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "sagm_jax.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        # As a terminal's Ctrl-C finds it, even when pytest itself runs in the
        # background of a shell (which starts it with SIGINT ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    results = workdir / "results.jsonl"
    deadline = time.monotonic() + 240
    while not (results.exists() and results.read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=600)  # a loaded machine saves slowly
    finally:
        process.kill()
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "Stopped." in err and "Resume from the last checkpoint with the same command" in err
    assert f"python -m sagm_jax.main {' '.join(args)}" in err
    steps = [json.loads(line)["step"] for line in results.read_text().splitlines()]
    # The relaunch resumes where the records stopped (checkpoint of the last evaluation).
    result = main(*args, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed at step" in result.stdout
    again = [json.loads(line)["step"] for line in results.read_text().splitlines()]
    assert again[: len(steps) - 1] == steps[: len(steps) - 1] and again[-1] == 19
    # Without a terminal the progress bar is lines, one every 5% at most, not redraws.
    bars = [line for line in result.stderr.splitlines() if "/20 [" in line]
    assert "\r" not in result.stderr and 2 <= len(bars) <= 21, result.stderr[-2000:]
    # A relaunch of the finished run counts its own start-up (imports, checks) as its time.
    began = time.monotonic()
    finished = main(*args, timeout=900)
    took = time.monotonic() - began
    launch = re.search(r"(\d+)m(\d\d)s this launch\)", finished.stdout)
    assert launch, finished.stdout[-2000:]
    seconds = 60 * int(launch.group(1)) + int(launch.group(2))
    assert took / 2 - 1 <= seconds <= took + 1, (seconds, took)


# --- the pre-start check of test_envs, valid examples, did you mean --------------------


@pytest.mark.parametrize(
    "test_envs,expected",
    [
        ((0, 1), "config.test_envs=(0, 1): expected a set that leaves a training environment"),
        ((2,), "config.test_envs=(2,): expected indices of ImageFolder's environments"),
    ],
)
def test_image_folder_test_envs_are_checked_before_the_run(tmp_path, test_envs, expected):
    config = mnist_config("ImageFolder")
    config.data_dir, config.test_envs = image_folder(tmp_path / "data"), test_envs
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), ["main"])
    message = flat(str(error.value))
    assert "1 thing(s) to fix" in message and expected in message, message
    assert "0 a, 1 b" in message  # the environments, by index and folder
    config.test_envs = (1,)
    cli.preflight(config, str(tmp_path / "run"), ["main"])


def test_image_folder_test_envs_covering_every_environment_exit_2(tmp_path):
    data = image_folder(tmp_path / "data")
    result = main(
        f"--config={DIGITS}",
        f"--workdir={tmp_path / 'run'}",
        "--config.dataset=ImageFolder",
        f"--config.data_dir={data}",
        "--config.test_envs=0,1",
        f"--config.cache_dir={tmp_path / 'cache'}",
    )
    assert result.returncode == 2, result.stderr
    assert "leaves a training environment" in result.stderr
    assert "Run directory:" not in result.stdout and not os.path.exists(tmp_path / "run")


def broken_image_folder(root):
    """An image folder with four problems: domain b lacks class y (it has z), domain c
    holds its images directly (a flat layout), domain d is empty."""
    from PIL import Image

    image_folder(root, domains=("a",))
    image_folder(root, domains=("b",), classes=("x", "z"))
    os.makedirs(root / "c")
    Image.new("RGB", (8, 8)).save(root / "c" / "0.png")
    os.makedirs(root / "d")
    return str(root)


def test_image_folder_layout_and_batch_problems_are_listed_together(tmp_path):
    config = mnist_config("ImageFolder")
    config.data_dir, config.batch_per_env = broken_image_folder(tmp_path / "data"), 3
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), ["main"], device_count=2)
    message = flat(str(error.value))
    root = tmp_path / "data"
    assert "5 thing(s) to fix" in message, message
    assert f"{root / 'c'} holds 1 image file(s) but no class sub-folders" in message
    assert f"{root / 'd'} is empty" in message
    assert "domain a lacks the class folder(s) ['z']" in message
    assert "domain b lacks the class folder(s) ['y']" in message
    # 4 domains, test_envs (0,): 3 training environments x 3 examples = 9 per step.
    assert "9 examples per step" in message and "among the 2 devices" in message
    assert not os.path.exists(tmp_path / "run")


def test_a_published_dataset_with_other_classes_is_a_pre_start_problem(tmp_path):
    from PIL import Image

    for domain in ("art_painting", "cartoon", "photo", "sketch"):
        for name in ("dog", "horse", "person"):
            os.makedirs(tmp_path / "PACS" / domain / name)
            Image.new("RGB", (8, 8)).save(tmp_path / "PACS" / domain / name / "0.png")
    config = cli.load_config_file(os.path.join(REPO, "configs", "pacs.py"))
    config.data_dir, config.pretrained_weights = str(tmp_path), "none"
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), ["main"])
    message = flat(str(error.value))
    assert "1 thing(s) to fix" in message
    assert "has 3 class folders (dog, horse, person), expected 7" in message


@pytest.mark.parametrize(
    "devices,batch_per_env,eval_batch_size,expected",
    [
        (4, 3, 0, ["15 examples per step"]),  # 5 training environments x 3
        (5, 3, 0, []),
        (4, 4, 6, ["config.eval_batch_size=6"]),
        (8, 3, 0, []),  # with config.num_devices=5 below: 15 divides among 5
    ],
)
def test_a_batch_that_does_not_divide_among_the_devices_is_a_pre_start_problem(
    tmp_path, devices, batch_per_env, eval_batch_size, expected
):
    config = mnist_config("RotatedDigits")  # six environments, test_envs (0,)
    config.batch_per_env, config.eval_batch_size = batch_per_env, eval_batch_size
    if devices == 8:
        config.num_devices = 5
    run = str(tmp_path / "run")
    if not expected:
        cli.preflight(config, run, ["main"], device_count=devices)
        return
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, run, ["main"], device_count=devices)
    message = flat(str(error.value))
    assert "1 thing(s) to fix" in message and expected[0] in message, message
    assert f"among the {devices} devices" in message


def test_a_method_hyperparameter_of_a_method_not_in_the_run_is_refused(tmp_path):
    path = os.path.join(REPO, DIGITS)
    config = cli.load_config_file(path)  # objective erm, algorithm sagm
    config.miro_ld, config.rho = 5.0, 0.1
    argv = ["main", f"--config={path}", "--config.miro_ld=5", "--config.rho=0.1"]
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), argv)
    message = flat(str(error.value))
    assert "1 thing(s) to fix" in message
    assert "--config.miro_ld=5.0: miro_ld is a hyperparameter of objective miro" in message
    example = message.split("For example: ", 1)[1]
    assert "--config.miro_ld" not in example and "--config.rho=0.1" in example
    # The method in the run: no problem.
    config.objective = "miro"
    cli.preflight(config, str(tmp_path / "run"), argv + ["--config.objective=miro"])


def test_main_lists_layout_and_setting_problems_before_the_run_directory(tmp_path):
    data = broken_image_folder(tmp_path / "data")
    result = main(
        f"--config={DIGITS}",
        f"--workdir={tmp_path / 'run'}",
        "--config.dataset=ImageFolder",
        f"--config.data_dir={data}",
        "--config.miro_ld=5",
        f"--config.cache_dir={tmp_path / 'cache'}",
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    err = flat(result.stderr)
    assert "5 thing(s) to fix" in err and "objective miro" in err, err
    assert "Traceback" not in result.stderr and "Run directory:" not in result.stdout
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "cache")


def overrides(command: str) -> dict:
    """``{KEY: VALUE}`` of the ``--config.KEY=VALUE`` words of an example command."""
    words = command.split()
    return dict(w[len("--config.") :].split("=", 1) for w in words if w.startswith("--config."))


def test_the_example_after_invalid_values_is_a_valid_command(tmp_path):
    path = os.path.join(REPO, DIGITS)
    argv = ["main", f"--config={path}", "--config.rho=-1", "--config.lr=0.1"]
    argv += ["--config.dropout=2.0", f"--workdir={tmp_path / 'run'}"]
    config = cli.load_config_file(path)
    config.rho, config.lr, config.dropout = -1.0, 0.1, 2.0
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), argv)
    example = str(error.value).split("For example:\n", 1)[1].strip()
    assert example.startswith("python -m sagm_jax.main ")
    assert "--config.rho=-1" not in example and "--config.dropout=2.0" not in example
    assert "--config.lr=0.1" in example  # a valid override of the user's is kept
    # Independently: the example's overrides on the config file give a config with no
    # problem.
    fixed = cli.load_config_file(path)
    for key, value in overrides(example).items():
        fixed[key] = type(fixed[key])(value)
    assert config_problems(fixed) == []


def test_a_misspelt_key_gets_did_you_mean():
    config = cli.load_config_file(os.path.join(REPO, DIGITS))
    with pytest.raises(cli.UsageError) as error:
        cli.check_overrides(["--config.step=3"], config, DIGITS)
    message = str(error.value)
    assert "did you mean `steps`?" in message
    assert "log_every" not in message  # not every key
    with pytest.raises(cli.UsageError) as error:
        cli.check_overrides(["--config.zzzzzz=3"], config, DIGITS)
    assert "did you mean" not in str(error.value) and "Valid keys: " in str(error.value)
    with pytest.raises(cli.UsageError) as error:  # compared case-insensitively
        cli.check_overrides(["--config.STEPS=3"], config, DIGITS)
    assert "did you mean `steps`?" in str(error.value)


def test_a_misspelt_name_gets_did_you_mean(tmp_path):
    config = mnist_config("RotatedDigits")
    config.algorithm, config.objective = "Fish", "corall"
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), ["main", f"--config={DIGITS}"])
    message = flat(str(error.value))
    assert "config.algorithm=Fish: expected one of" in message
    assert "Did you mean --config.algorithm=fish?" in message
    assert "Did you mean --config.objective=coral?" in message


def test_the_summary_labels_environments_as_the_tables_do(capsys):
    from sagm_jax.results import collect as collect_results
    from sagm_jax.training import summary

    records = []
    for step, accs in ((0, [0.1, 0.5, 0.5]), (10, [0.25, 0.8, 0.9])):
        record = {"step": step, "args": {"dataset": "RotatedDigits"}}
        for env, acc in enumerate(accs):
            record[f"env{env}_in_acc"], record[f"env{env}_out_acc"] = acc, acc * (env > 0)
        records.append(record)
    summary.print_summary(records, [0], ["0", "15", "30"])
    out = capsys.readouterr().out
    assert "env0 0° (test)" in out and "env1 15° (train)" in out and "env0 0 (test)" not in out
    assert out.rstrip().endswith("env0 0° 25.0%")
    summary.print_summary(records[:1], [0], None)  # no names: the index alone
    assert "env0 (test)" in capsys.readouterr().out
    # The tables' header for the same environments.
    ood = type("Sweep", (), {"test_envs": {"RotatedDigits": [0, 1]}, "methods": []})()
    table = collect_results.dataset_table(ood, "RotatedDigits", ["0", "15"], "x", False, "±")
    assert "| Algorithm | 0° | 15° | Avg |" in table


# --- the first hour ----------------------------------------------------------------------


@pytest.mark.parametrize("parent", ["/proc", "/sys"])
def test_a_workdir_that_cannot_be_created_is_a_pre_start_problem(tmp_path, parent):
    workdir = os.path.join(parent, "sagm_jax_test", "run")
    config = mnist_config("RotatedDigits")
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, workdir, ["main", f"--workdir={workdir}"])
    message = flat(str(error.value))
    assert "1 thing(s) to fix" in message
    assert f"--workdir={workdir}: " in message and "choose a directory you can write" in message
    assert not os.path.exists(workdir)


def test_main_refuses_a_workdir_under_proc_before_anything_starts(tmp_path):
    result = main(f"--config={DIGITS}", "--workdir=/proc/sagm_jax_test/run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--workdir=/proc/sagm_jax_test/run: " in result.stderr
    assert "Traceback" not in result.stderr and "Run directory:" not in result.stdout


def test_the_workdir_probe_leaves_nothing_behind(tmp_path):
    config = mnist_config("RotatedDigits")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "results.jsonl").write_text("")
    for workdir in (tmp_path / "new" / "run", tmp_path / "existing"):
        cli.preflight(config, str(workdir), ["main"])
    assert sorted(os.listdir(tmp_path)) == ["existing"]
    assert os.listdir(tmp_path / "existing") == ["results.jsonl"]


def test_a_text_file_as_weights_is_named_before_the_data_is_read(tmp_path):
    weights = tmp_path / "resnet50-0676ba61.pth"
    weights.write_text("<html>Access denied</html>")
    config = base_config()
    config.update(dict(dataset="PACS", data_dir=str(tmp_path), pretrained_weights=str(weights)))
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), ["main"])
    message = flat(str(error.value))
    assert f"--config.pretrained_weights={weights}: not a weights file" in message


def test_weights_for_the_mnist_cnn_are_a_pre_start_problem(tmp_path):
    config = mnist_config("RotatedDigits")
    config.pretrained_weights = "resnet50-0676ba61.pth"
    argv = ["main", "--config.pretrained_weights=resnet50-0676ba61.pth"]
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, str(tmp_path / "run"), argv)
    message = flat(str(error.value))
    assert "1 thing(s) to fix" in message and "config.arch=mnist_cnn" in message
    example = message.split("For example: ", 1)[1]
    assert "pretrained_weights" not in example  # the example drops the weights


def test_a_resnet_from_scratch_with_frozen_batchnorm_is_warned_before_the_run(tmp_path, capsys):
    config = base_config()
    data = image_folder(tmp_path / "data")
    config.update(dict(dataset="ImageFolder", data_dir=data, pretrained_weights="none"))
    cli.preflight(config, str(tmp_path / "run"), ["main"])  # a warning, not a problem
    err = flat(capsys.readouterr().err)
    assert "warning:" in err and "--config.freeze_batchnorm=False" in err
    config.freeze_batchnorm = False
    cli.preflight(config, str(tmp_path / "run"), ["main"])
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "dataset,argv,expected",
    [
        ("PACS", ["main", "--config.objective=arm"], 8),  # DomainBed's ARM batch
        ("DomainNet", ["main", "--config.objective=arm"], 8),
        ("PACS", ["main", "--config.objective=arm", "--config.batch_per_env=16"], 16),
        ("PACS", ["main", "--config.objective=mtl"], 32),  # only ARM's is fixed
        ("RotatedDigits", ["main", "--config.objective=arm"], 64),  # MNIST-like: its own
    ],
)
def test_arm_trains_on_domainbeds_batch_of_8_unless_the_command_line_sets_one(
    dataset, argv, expected
):
    from sagm_jax.config import resnet50_config

    config = mnist_config(dataset) if dataset == "RotatedDigits" else resnet50_config(dataset)
    config.objective = argv[1].split("=")[1]
    if len(argv) > 2:
        config.batch_per_env = int(argv[2].split("=")[1])
    before = config.batch_per_env
    lines = cli.reference_defaults(config, argv)
    assert config.batch_per_env == expected
    lines = [line for line in lines if "batch_per_env" in line]
    assert bool(lines) == (expected != before)
    if lines:
        assert "batch_per_env=8" in lines[0] and "--config.batch_per_env=N" in lines[0]


@pytest.mark.parametrize(
    "argv,says",
    [
        (["main", "--config.objective=mtl"], True),  # MTL + the config's SAGM
        (["main", "--config.objective=mtl", "--config.algorithm=sagm"], False),  # meant
        (["main", "--config.objective=mtl", "--config.algorithm=erm"], False),
        (["main", "--config.algorithm=sam"], False),  # no objective named
    ],
)
def test_an_objective_named_alone_is_told_it_trains_under_the_configs_rule(argv, says):
    """configs/rotated_digits.py's rule is SAGM: ``--config.objective=mtl`` alone trains
    MTL + SAGM, not DomainBed's MTL (plain Adam); the start says so, and how to get it."""
    config = cli.load_config_file(os.path.join(REPO, DIGITS))
    for word in argv[1:]:
        key, value = word[len("--config."):].split("=")
        config[key] = value
    lines = cli.reference_defaults(config, argv)
    assert bool(lines) == says, lines
    if says:
        assert "algorithm=sagm" in lines[0] and "--config.algorithm=erm" in lines[0]


def test_a_methods_per_dataset_defaults_set_a_single_run_and_the_search(monkeypatch):
    """``Method.by_dataset``: DomainBed's defaults that depend on the dataset reach a single
    run (the method's own keys and its batch, not the config file's lr) and the sweep's
    setting 0 and draws (lr too)."""
    from sagm_jax import methods
    from sagm_jax.config import resnet50_config
    from sagm_jax.methods.registry import choice, fixed
    from sagm_jax.sweep import hparams

    entry = methods.OBJECTIVES["sd"]

    def by_dataset(dataset, mnist_like):
        return {} if mnist_like else {"sd_reg": (0.5, fixed(0.5)), "batch_per_env": (88, fixed(88)),
                                      "lr": (2e-5, choice((2e-5, 3e-5)))}

    monkeypatch.setitem(methods.OBJECTIVES, "sd", entry._replace(
        method=entry.method._replace(by_dataset=by_dataset)))
    config = resnet50_config("PACS")
    config.objective, lr = "sd", config.lr
    lines = cli.reference_defaults(config, ["main", "--config.objective=sd",
                                            "--config.algorithm=erm"])
    assert (config.sd_reg, config.batch_per_env, config.lr) == (0.5, 88, lr)
    assert any("sd_reg=0.5, batch_per_env=88" in line for line in lines), lines
    config = resnet50_config("PACS")
    config.objective = "sd"
    cli.reference_defaults(config, ["main", "--config.objective=sd", "--config.sd_reg=0.2"])
    assert config.sd_reg != 0.5 and config.batch_per_env == 88
    assert hparams.random_hparams("erm", "PACS", 0, 0, "sd")["sd_reg"] == 0.5
    drawn = [hparams.random_hparams("erm", "PACS", seed, 0, "sd") for seed in (1, 2, 3, 4)]
    assert {d["batch_per_env"] for d in drawn} == {88} and {d["lr"] for d in drawn} <= {2e-5, 3e-5}
    assert hparams.random_hparams("erm", "RotatedDigits", 0, 0, "sd")["sd_reg"] == entry.method.hyperparameters[0].default
