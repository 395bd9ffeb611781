"""Every "For example:" command that ``python -m sagm_jax.main`` prints after a refusal
passes the pre-start checks itself, once the user supplies what its placeholders name
(DATA_DIR, the ImageNet weights file): each refusal below is triggered through
``cli.preflight``, its example is parsed as ``sagm_jax.main`` parses a command line
(absl and ml-collections' config file flag), and the checks run again on it, the checks
only (no training)."""

import os
import shlex
import zipfile

import pytest
from absl import flags
from ml_collections import config_flags
from run_fixtures import image_folder

from sagm_jax import cli, models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(REPO, "configs", "rotated_digits.py")
FOLDER = os.path.join(REPO, "configs", "image_folder.py")


def parse(argv: list[str]):
    """(config, workdir) of ``python -m sagm_jax.main ARGV[1:]``, parsed by the flags
    ``sagm_jax/main.py`` defines, on flag values of their own (the config flag reads its
    overrides from the argv it is given)."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "", flag_values=values, lock_config=True, sys_argv=argv
    )
    flags.DEFINE_string("workdir", None, "", flag_values=values)
    values(argv)
    return values.config, values.workdir


def example_of(argv: list[str]) -> list[str]:
    """The words after ``python -m sagm_jax.main`` of the refusal's "For example:" line."""
    config, workdir = parse(argv)
    with pytest.raises(cli.UsageError) as error:
        cli.preflight(config, workdir, argv, device_count=1)
    message = str(error.value)
    assert "For example:\n" in message, message
    line = message.split("For example:\n", 1)[1].strip().splitlines()[0]
    assert line.startswith(cli.PROGRAM + " "), line
    return shlex.split(line[len(cli.PROGRAM) :])


def supplied(words: list[str], tmp_path) -> list[str]:
    """The example with its placeholders replaced by what a user brings: DATA_DIR by an
    image folder, a weights file name by a file of that name in a zip archive's format
    (the format torch.save writes; the checks read its first bytes and directory)."""
    out = []
    for word in words:
        if word == "--config.data_dir=DATA_DIR":
            word = f"--config.data_dir={image_folder(tmp_path / 'supplied')}"
        for name in models.WEIGHTS_FILES.values():
            if word == f"--config.pretrained_weights={name}":
                with zipfile.ZipFile(tmp_path / name, "w") as archive:
                    archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
                word = f"--config.pretrained_weights={tmp_path / name}"
        out.append(word)
    return out


# Each refusal: (its command's words after the program, what its example must hold).
REFUSALS = {
    "mixstyle on the offline default": ([f"--config={DIGITS}", "--config.mixstyle=True"], []),
    "Mixstyle2 on the MNIST CNN, asked for by name": (
        [
            f"--config={DIGITS}",
            "--config.arch=mnist_cnn",
            "--config.mixstyle=True",
            "--config.mixstyle_mix=crossdomain",
            "--config.freeze_batchnorm=True",
        ],
        ["--config.mixstyle_mix=crossdomain"],
    ),
    "mixstyle on an image folder with the MNIST CNN": (
        [
            f"--config={DIGITS}",
            "--config.dataset=ImageFolder",
            "--config.data_dir=FOLDER",
            "--config.mixstyle=True",
            "--config.image_size=16",
        ],
        [],
    ),
    "invalid values": (
        [f"--config={DIGITS}", "--config.rho=-1", "--config.dropout=2.0", "--config.lr=0.1"],
        ["--config.lr=0.1"],
    ),
    "weights for the MNIST CNN": (
        [f"--config={DIGITS}", "--config.pretrained_weights=resnet50-0676ba61.pth"],
        [],
    ),
    "a hyperparameter of a method not in the run": (
        [f"--config={DIGITS}", "--config.miro_ld=5"],
        [],
    ),
    "an odd batch for Mixstyle2": (
        [
            f"--config={DIGITS}",
            "--config.arch=resnet18",
            "--config.pretrained_weights=none",
            "--config.mixstyle=True",
            "--config.mixstyle_mix=crossdomain",
            "--config.batch_per_env=15",
        ],
        ["--config.mixstyle=True"],
    ),
    "the paper's image folder command without data or weights": ([f"--config={FOLDER}"], []),
    "an image folder's test environment out of range": (
        [
            f"--config={FOLDER}",
            "--config.data_dir=FOLDER",
            "--config.pretrained_weights=none",
            "--config.test_envs=5",
        ],
        [],
    ),
    "an unusable workdir": ([f"--config={DIGITS}", "--workdir=FILE/run"], []),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_every_example_command_passes_the_checks(name, tmp_path):
    words, kept = REFUSALS[name]
    folder = None
    fixed = []
    for word in words:
        if word.endswith("=FOLDER"):
            folder = folder or image_folder(tmp_path / "data")
            word = word.replace("=FOLDER", f"={folder}")
        if word == "--workdir=FILE/run":
            (tmp_path / "file").write_text("")
            word = f"--workdir={tmp_path / 'file' / 'run'}"
        fixed.append(word)
    if not any(w.startswith("--workdir") for w in fixed):
        fixed.append(f"--workdir={tmp_path / 'run'}")
    example = example_of(["main", *fixed])
    for word in kept:
        assert word in example, (word, example)
    config, workdir = parse(["main", *supplied(example, tmp_path)])
    cli.preflight(config, workdir or cli.default_workdir(config), ["main", *example], 1)


def test_the_documented_mixstyle_offline_commands_pass_the_checks(tmp_path, monkeypatch):
    """docs/methods.md's "MixStyle offline" block, command by command: the export runs
    (it writes the image folder the next command reads), each run passes the checks."""
    from sagm_jax.data import export

    with open(os.path.join(REPO, "docs", "methods.md")) as handle:
        text = handle.read()
    block = text.split("### MixStyle offline", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    commands = [shlex.split(line) for line in lines if not line.startswith("#")]
    monkeypatch.chdir(tmp_path)  # the commands name folders relative to where they run
    runs = 0
    for words in commands:
        if words[:3] == ["python", "-m", "sagm_jax.data.export"]:
            assert export.main(words[3:]) == 0
            continue
        assert words[:3] == ["python", "-m", "sagm_jax.main"], words
        argv = ["main", *(w.replace("=configs/", f"={REPO}/configs/") for w in words[3:])]
        assert "--config.mixstyle=True" in argv and "--config.arch=resnet18" in argv
        config, workdir = parse(argv)
        cli.preflight(config, workdir or cli.default_workdir(config), argv, 1)
        runs += 1
    assert runs == 2
