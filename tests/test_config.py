"""sagm_jax.config and configs/*.py: the paper's numbers, every field's check, sections."""

import glob
import os
import runpy

import numpy as np
import pytest
from ml_collections import ConfigDict

from sagm_jax.config import (
    FIELDS,
    all_fields,
    fields,
    base_config,
    config_problems,
    config_warnings,
    flat_keys,
    section,
    validate,
    weights_problem,
)
from sagm_jax.formatting import flag_value

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The paper's SAGM hyperparameters, as docs/protocol.md lists them.
PROTOCOL = {
    "pacs": ("PACS", 3e-5, 1e-4, 1e-3, 5001),
    "vlcs": ("VLCS", 1e-5, 1e-4, 1e-3, 5001),
    "office_home": ("OfficeHome", 1e-5, 1e-4, 5e-4, 5001),
    "terra_incognita": ("TerraIncognita", 1e-5, 1e-4, 1e-3, 5001),
    "domain_net": ("DomainNet", 3e-5, 1e-6, 5e-4, 15001),
}


def load(name):
    return runpy.run_path(os.path.join(REPO, "configs", f"{name}.py"))["get_config"]()


@pytest.mark.parametrize("name", sorted(PROTOCOL))
def test_dataset_configs_carry_the_papers_hyperparameters(name):
    dataset, lr, weight_decay, alpha, steps = PROTOCOL[name]
    config = load(name)
    assert (config.dataset, config.arch, config.algorithm) == (dataset, "resnet50", "sagm")
    assert (config.lr, config.weight_decay, config.alpha, config.steps) == (
        lr,
        weight_decay,
        alpha,
        steps,
    )
    assert (config.dropout, config.rho, config.batch_per_env, config.eval_every) == (
        0.5,
        0.05,
        32,
        100,
    )
    assert config.freeze_batchnorm and config.combine == "mean" and config.perturbation == "global"
    config.pretrained_weights = "resnet50.safetensors"
    validate(config)


def test_every_config_file_validates():
    files = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
    assert len(files) == 9
    for path in files:
        config = runpy.run_path(path)["get_config"]()
        if config.arch != "mnist_cnn":
            config.pretrained_weights = "none"
        validate(config)
    mnist = load("rotated_mnist")
    assert (mnist.lr, mnist.weight_decay, mnist.batch_per_env, mnist.arch) == (
        1e-3,
        0.0,
        64,
        "mnist_cnn",
    )
    assert load("colored_mnist").test_envs == (2,)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("algorithm", "adamw", "config.algorithm=adamw: expected one of erm, sam"),
        ("combine", "avg", "config.combine=avg"),
        ("steps", 0, "config.steps=0: expected a positive integer"),
        ("dropout", 1.0, "config.dropout=1.0"),
        ("pretrained_weights", "", "--config.pretrained_weights=FILE is missing"),
    ],
)
def test_validate_names_the_key(key, value, message):
    config = base_config()
    config.pretrained_weights = "weights.pth"
    config[key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(config)


def test_mixstyle_needs_a_resnet():
    config = load("rotated_digits")
    config.mixstyle = True
    with pytest.raises(ValueError, match="mixstyle=True.*mnist_cnn"):
        validate(config)


# --- every field checked, each problem naming its key, all at once --------------------


def unlocked(**values):
    """The base config with ``values``, in a ConfigDict that takes values of any type
    (as a config file that builds its own ConfigDict may)."""
    # A ResNet starts from a weights file; the MNIST CNN takes none.
    weights = "" if values.get("arch") == "mnist_cnn" else "w.pth"
    return ConfigDict({**base_config().to_dict(), "pretrained_weights": weights, **values})


BAD_VALUES = [
    ("lr", -3e-5, "a number > 0"),
    ("lr", 0.0, "a number > 0"),
    ("lr", float("nan"), "a number > 0"),
    ("lr", "3e-5", "a number > 0"),
    ("weight_decay", -1e-4, "a number >= 0"),
    ("rho", -0.05, "a number >= 0"),
    ("rho", 0.0, "with rho 0, algorithm=sagm does not perturb"),
    ("alpha", -1e-3, "in [0, 1)"),
    ("alpha", 1.0, "in [0, 1)"),
    ("gsam_alpha", -0.1, "in [0, 1]"),
    ("gsam_alpha", 1.5, "in [0, 1]"),
    ("test_envs", (0, 0), "distinct"),
    ("test_envs", (-1,), "distinct, >= 0"),
    ("test_envs", ("abc",), "environment indices"),
    ("test_envs", "0", "environment indices"),
    ("test_envs", (6,), "indices of RotatedDigits's environments (0 0, 1 15"),
    ("test_envs", (True,), "environment indices"),
    ("num_devices", -1, "an integer >= 0"),
    ("trial_seed", -1, "an integer >= 0"),
    ("seed", 1.5, "an integer >= 0"),
    ("holdout_fraction", 1.0, "in (0, 1)"),
    ("batch_per_env", 0, "a positive integer"),
    ("eval_batch_size", -8, "an integer >= 0"),  # 0: the throughput default
    ("image_size", 0, "a positive integer"),
    ("store_short_side", 100, "an integer >= config.image_size=224"),
    ("store_budget_gb", -1.0, "a number >= 0"),
    ("cnn_widths", (16, 32, 32), "4 positive multiples of 8"),
    ("cnn_widths", (12, 32, 32, 32), "4 positive multiples of 8"),
    ("mixstyle_after", (4,), "distinct ResNet stages among 1, 2, 3"),
    ("mixstyle_after", (1, 1), "distinct ResNet stages"),
    ("mixstyle_after", ([1],), "distinct ResNet stages"),
    ("dataset", "Nope", "one of PACS, VLCS"),
    ("arch", "vgg16", "one of resnet18, resnet50, resnet50_augmix,"),
    ("algorithm", "adamw", "one of erm, sam, gsam, sagm, erm_sam"),
    ("combine", "avg", "one of mean, sum"),
    ("perturbation", "local", "one of global, per_device"),
    ("split", "random", "one of domainbed, in_domain"),
    ("compute_dtype", "float16", "one of float32, bfloat16"),
    ("input", "gpu", "one of device, tf"),
    ("image_store", "disk", "one of auto, cache, compressed, stream"),
    ("dropout", -0.1, "in [0, 1)"),
    ("steps", True, "a positive integer"),
    ("eval_every", 0, "a positive integer"),
    ("log_every", 2.5, "a positive integer"),
    ("checkpoint", "yes", "True or False"),
    ("mixstyle", 1, "True or False"),
    ("all_test_envs", None, "True or False"),
    ("freeze_batchnorm", "True", "True or False"),
    ("augment_validation", 0, "True or False"),
    ("skip_bad_files", None, "True or False"),
    ("adaptive", "no", "True or False"),
    ("shared_dropout", 1, "True or False"),
    ("data_dir", None, "a string"),
    ("cache_dir", 3, "a string"),
    ("pretrained_weights", None, "a path, or 'none'"),
]


@pytest.mark.parametrize(
    "key,value,expected", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES]
)
def test_each_bad_value_is_one_problem_naming_its_key(key, value, expected):
    config = unlocked(**{"dataset": "RotatedDigits", "arch": "mnist_cnn", key: value})
    problems = config_problems(config)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"config.{key}={flag_value(value)}: expected "), problems
    assert expected in problems[0]


def test_every_field_is_checked_for_its_type():
    # bytes is no field's type: every field must reject it, naming itself, and the
    # checks of the other fields must not trip over it.
    for key in FIELD_ORDER:
        problems = config_problems(unlocked(**{key: b"?"}))
        assert [p for p in problems if p.startswith(f"config.{key}=b'?': expected")], key


def test_all_problems_are_reported_at_once_one_line_each():
    values = dict(lr=-1.0, rho=-0.05, alpha=2.0, gsam_alpha=-1.0, test_envs=(1, 1))
    values.update(num_devices=4, steps=0, checkpoint="yes")
    problems = config_problems(unlocked(**values), device_count=2)
    keys = [p.split("=", 1)[0] for p in problems]
    assert keys == [f"config.{k}" for k in FIELD_ORDER if k in values], problems
    with pytest.raises(ValueError) as error:
        validate(unlocked(**values), device_count=2)
    assert str(error.value).splitlines() == problems


def test_num_devices_is_bounded_by_the_devices_jax_sees():
    config = unlocked(num_devices=4)
    assert config_problems(config) == []  # device count unknown
    assert config_problems(config, device_count=4) == []
    (problem,) = config_problems(config, device_count=2)
    assert problem.startswith("config.num_devices=4: expected at most the 2 device(s)")
    assert config_problems(unlocked(num_devices=0), device_count=1) == []


def test_erm_may_leave_rho_at_zero_but_not_negative():
    assert config_problems(unlocked(algorithm="erm", rho=0.0)) == []
    assert config_problems(unlocked(algorithm="erm", rho=-1.0))


def test_mixstyle_with_no_stage_is_a_problem():
    (problem,) = config_problems(unlocked(mixstyle=True, mixstyle_after=()))
    assert problem.startswith("config.mixstyle_after=(): expected")


def test_paper_configs_have_no_problem():
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))):
        config = runpy.run_path(path)["get_config"]()
        if config.arch != "mnist_cnn":
            config.pretrained_weights = "w.pth"
        assert config_problems(config, device_count=1) == [], path
        config.algorithm = "gsam"
        assert config_problems(config, device_count=8) == [], path


FIELD_ORDER = [field.key for field in all_fields()]


# --- the weights a ResNet starts from ----------------------------------------------------


def test_the_weights_problem_is_one_line_with_where_to_get_them(tmp_path):
    config = unlocked(arch="resnet50", pretrained_weights="")
    missing = weights_problem(config)
    assert missing.startswith("--config.pretrained_weights=FILE is missing.")
    assert "https://download.pytorch.org/models/resnet50-0676ba61.pth" in missing
    assert "sagm_jax.models.convert resnet50-0676ba61.pth resnet50.safetensors" in missing
    assert config_problems(config) == [missing]
    config.arch = "resnet18"
    assert "resnet18-f37072fd.pth" in weights_problem(config)
    for arch, weights in (("resnet50", "none"), ("resnet50", "None"), ("mnist_cnn", "")):
        assert weights_problem(unlocked(arch=arch, pretrained_weights=weights)) is None


def test_only_the_command_lines_check_looks_for_the_weights_file(tmp_path):
    config = unlocked(arch="resnet50", pretrained_weights=str(tmp_path / "w.npz"))
    assert weights_problem(config) is None and config_problems(config) == []
    (problem,) = config_problems(config, check_files=True)
    assert problem.startswith(f"--config.pretrained_weights={tmp_path / 'w.npz'}: no such file.")
    np.savez(tmp_path / "w.npz", weight=np.zeros(3, np.float32))
    assert config_problems(config, check_files=True) == []


# --- weights files and weights the network cannot take --------------------------------------


def _safetensors(header: bytes, data: bytes) -> bytes:
    """A .safetensors file written by hand from its published layout: an 8-byte
    little-endian header length, the JSON header, then the data."""
    return len(header).to_bytes(8, "little") + header + data


GOOD_HEADER = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
NOT_WEIGHTS = [
    ("w.pth", b"<!DOCTYPE html><html>404 Not Found</html>"),  # a failed download
    ("w.pt", b""),
    ("w.safetensors", b"version https://git-lfs.github.com/spec/v1\n"),  # an LFS pointer
    ("w.safetensors", _safetensors(GOOD_HEADER, b"\0" * 8)[:40]),  # truncated header
    ("w.safetensors", _safetensors(GOOD_HEADER, b"\0" * 4)),  # truncated data
    ("w.safetensors", _safetensors(b"[1, 2]", b"")),  # header not a JSON object
    ("w.npz", b"PK\x03\x04 and then nothing"),  # a zip cut short: no central directory
    ("w.npz", b"0123456789" * 10),
    ("w.bin", b"PK\x03\x04"),  # a torch zip (the hub's pytorch_model.bin) cut short
    ("w.h5", b"\x89HDF\r\n\x1a\n"),
]


@pytest.mark.parametrize(
    "name,content", NOT_WEIGHTS, ids=[f"{i}-{name}" for i, (name, _) in enumerate(NOT_WEIGHTS)]
)
def test_a_file_that_is_not_weights_is_a_problem_before_the_run(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    config = unlocked(arch="resnet50", pretrained_weights=str(path))
    (problem,) = config_problems(config, check_files=True)
    assert problem.startswith(f"--config.pretrained_weights={path}: not a weights file"), problem
    for suffix in (".pth", ".pt", ".safetensors", ".npz"):
        assert suffix in problem
    assert weights_problem(config) is None  # without check_file, the file is not read


def test_weights_files_of_every_accepted_format_pass_the_check(tmp_path):
    import pickle
    import zipfile

    files = {
        "legacy.pth": pickle.dumps({"fc.bias": [0.0]}, protocol=2),  # torch.save before 1.6
        "w.safetensors": _safetensors(GOOD_HEADER, b"\0" * 8),
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with zipfile.ZipFile(tmp_path / "zip.pth", "w") as archive:  # torch.save since 1.6
        archive.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
    np.savez(tmp_path / "w.npz", weight=np.zeros(3, np.float32))
    for name in ("legacy.pth", "w.safetensors", "zip.pth", "w.npz"):
        config = unlocked(arch="resnet18", pretrained_weights=str(tmp_path / name))
        assert config_problems(config, check_files=True) == [], name


def test_weights_given_to_the_mnist_cnn_are_refused():
    config = unlocked(dataset="RotatedDigits", arch="mnist_cnn", pretrained_weights="w.pth")
    (problem,) = config_problems(config)
    assert problem.startswith("--config.pretrained_weights=w.pth: config.arch=mnist_cnn"), problem
    assert "resnet18, resnet50" in problem or "resnet50, resnet18" in problem
    for weights in ("", "none", "None"):
        config.pretrained_weights = weights
        assert config_problems(config, check_files=True) == [], weights


def test_a_resnet_from_scratch_with_frozen_batchnorm_is_warned_about():
    (warning,) = config_warnings(unlocked(arch="resnet50", pretrained_weights="none"))
    assert "config.freeze_batchnorm=True" in warning
    assert "--config.freeze_batchnorm=False" in warning
    for values in (
        dict(arch="resnet18", pretrained_weights="None", freeze_batchnorm=False),
        dict(arch="resnet50", pretrained_weights="w.pth"),  # the paper's setting
        dict(dataset="RotatedDigits", arch="mnist_cnn"),  # GroupNorm, no BatchNorm
    ):
        assert config_warnings(unlocked(**values)) == [], values


def test_flat_keys_name_nested_fields_as_the_command_line_does():
    config = ConfigDict({"lr": 0.1, "model": {"depth": 50, "head": {"width": 8}}})
    assert flat_keys(config) == ["lr", "model", "model.depth", "model.head", "model.head.width"]


# --- sections ----------------------------------------------------------------------


def test_section_gives_one_sections_values():
    config = load("pacs")
    optimizer, method = section(config, "optimizer"), section(config, "method")
    assert list(optimizer) == [field.key for field in FIELDS["optimizer"]]
    assert optimizer["lr"] == 3e-5 and method["alpha"] == 1e-3 and "steps" not in optimizer
    assert method["gsam_alpha"] == 0.01  # GSAM's paper setting, not SAGM's alpha
    every = {k: v for name in fields() for k, v in section(config, name).items()}
    assert every == config.to_dict()
    with pytest.raises(ValueError, match="section 'train': expected one of data, model"):
        section(config, "train")


# --- one registry of names ---------------------------------------------------------------


def test_config_checks_take_their_names_from_the_registries():
    from sagm_jax.data import registry
    from sagm_jax.models import ARCHS, create
    from sagm_jax.models.backbones import BACKBONES
    from sagm_jax.methods.registry import OBJECTIVES, UPDATE_RULES

    checks = {field.key: field.check for field in all_fields()}
    assert checks["algorithm"].names == tuple(UPDATE_RULES)
    assert checks["objective"].names == tuple(OBJECTIVES)
    assert checks["arch"].names is BACKBONES and tuple(BACKBONES) == ARCHS
    assert checks["dataset"].names == tuple(registry.DATASETS)
    for arch in ARCHS:  # every listed architecture is one create() builds
        create(arch, 3, cnn_widths=(8, 8, 8, 8))


def test_every_config_file_is_registered_with_its_dataset():
    from sagm_jax.data import registry

    files = sorted(
        os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
    )
    assert sorted(registry.CONFIG_FILES.values()) == files
    for name, path in registry.CONFIG_FILES.items():
        assert runpy.run_path(os.path.join(REPO, path))["get_config"]().dataset == name
    assert registry.PAPER_DATASETS == ("PACS", "VLCS", "OfficeHome", "TerraIncognita", "DomainNet")
    rotated = registry.get_spec("RotatedMNIST").domains
    assert rotated == ("0", "15", "30", "45", "60", "75")
    assert registry.get_spec("ColoredMNIST").domains == ("+90%", "+80%", "-90%")


# --- values that make no sense ------------------------------------------------------------


@pytest.mark.parametrize(
    "values,expected",
    [
        (dict(rho=1e9), "config.rho=1000000000.0: expected a number in [0, 10]"),
        (dict(steps=10**20), "config.steps=100000000000000000000: expected an integer <= 2147483647"),
        (dict(dataset="PACS", image_size=7), "config.image_size=7: expected an integer >= 32"),
        (dict(dataset="PACS", image_size=1), "config.image_size=1: expected an integer >= 32"),
        (dict(test_envs=(0, 1, 2, 3, 4, 5)), "leaves no training environment"),
    ],
)
def test_values_that_make_no_sense_are_bounded(values, expected):
    config = unlocked(**{"store_short_side": 320, **values})
    problems = config_problems(config)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_bounds_keep_sensible_values():
    # ASAM's largest published rho (2.0), ResNet at its total stride (32 px), a long run.
    for values in (dict(rho=2.0, adaptive=True), dict(dataset="PACS", image_size=32)):
        assert config_problems(unlocked(**values)) == [], values
    assert config_problems(unlocked(steps=2**31 - 1)) == []
    # The MNIST CNN reads 28x28 digits and never image_size.
    assert config_problems(unlocked(arch="mnist_cnn", image_size=7, store_short_side=7)) == []


def test_swads_tolerance_is_held_to_its_convergence_count_only_with_swad():
    values = dict(swad_n_converge=5, swad_n_tolerance=3)
    assert config_problems(unlocked(**values)) == []  # swad=False: neither is read
    problems = config_problems(unlocked(swad=True, **values))
    assert [p for p in problems if p.startswith("config.swad_n_tolerance")] == [
        "config.swad_n_tolerance=3: expected an integer >= config.swad_n_converge=5 "
        "(SWAD's window holds it)."
    ]


# --- settings that do not change the result ----------------------------------------------


def _md5_seed(config_dict, dropped):
    """DomainBed's seed_hash of the config without ``dropped``: computed here, not by
    sagm_jax."""
    import hashlib
    import json

    kept = {k: v for k, v in config_dict.items() if k not in dropped}
    text = json.dumps(kept, sort_keys=True, default=str)
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16) % 2**31


RESULT_FREE = dict(
    cache_dir="/elsewhere", data_dir="/moved", store_budget_gb=1.0, eval_cache_gb=2.0, log_every=7
)


def test_settings_that_do_not_change_the_result_keep_hparams_seed():
    from sagm_jax.training.rundir import hparams_seed

    config = base_config().to_dict()
    expected = _md5_seed(
        config,
        {"test_envs", "all_test_envs", "trial_seed", "seed", "num_devices", "hparams_seed"}
        | set(RESULT_FREE),
    )
    assert hparams_seed(config) == expected
    # A --hparams random setting carries its index, DomainBed's args.hparams_seed.
    assert hparams_seed({**config, "hparams_seed": 7}) == 7
    for key, value in RESULT_FREE.items():
        assert hparams_seed({**config, key: value}) == expected, key
    assert hparams_seed({**config, "num_devices": 4}) == expected  # global perturbation
    # Real hyperparameters, and the device count where it changes the result (m-sharpness).
    assert hparams_seed({**config, "lr": 1e-3}) != expected
    per_device = {**config, "perturbation": "per_device"}
    assert hparams_seed({**per_device, "num_devices": 4}) != hparams_seed(per_device)


def test_the_result_tables_group_runs_across_such_settings():
    from sagm_jax.results.collect import setting_key

    config = base_config().to_dict()

    def record(**values):
        return {"args": {}, "config": {**config, **values}}

    assert setting_key(record(**RESULT_FREE)) == setting_key(record())
    assert setting_key(record(lr=1e-3)) != setting_key(record())


def test_a_relaunch_changing_only_such_settings_is_accepted(tmp_path):
    from sagm_jax.training.rundir import RunDir, write_json

    config = base_config().to_dict()
    write_json(str(tmp_path / "config.json"), config)
    run = RunDir(str(tmp_path))
    run.check_config({**config, **RESULT_FREE, "num_devices": 2})
    with pytest.raises(ValueError, match=r"keys \['lr'\] differ"):
        run.check_config({**config, **RESULT_FREE, "lr": 1e-3})
    with pytest.raises(ValueError, match=r"keys \['num_devices'\] differ"):
        per_device = {**config, "perturbation": "per_device"}
        write_json(str(tmp_path / "config.json"), per_device)
        run.check_config({**per_device, "num_devices": 2})


def test_mldg_split_that_cannot_fit_the_datasets_environments_is_refused_before_set_up():
    config = load("colored_mnist")  # 3 environments: one held out leaves 2
    config.algorithm, config.mldg_n_meta_test = "mldg", 2
    (problem,) = [p for p in config_problems(config) if "mldg_n_meta_test" in p]
    assert "config.mldg_n_meta_test=2 with num_domains=2 training domains" in problem
    config.mldg_n_meta_test = 1
    assert config_problems(config) == []
    config.algorithm, config.mldg_n_meta_test = "erm", 2  # not MLDG: not its concern
    assert config_problems(config) == []
    config.dataset = "ImageFolder"  # domains unknown until listed: checked at set-up
    config.algorithm = "mldg"
    assert not any("mldg_n_meta_test" in p for p in config_problems(config))


@pytest.mark.parametrize("objective, reason", [("coral", "unbiased"), ("irm", "odd half")])
def test_an_objective_undefined_on_one_example_per_domain_is_refused(objective, reason):
    config = load("rotated_digits")
    config.objective, config.batch_per_env = objective, 1
    (problem,) = config_problems(config)
    assert problem.startswith(f"config.batch_per_env=1 with config.objective={objective}: ")
    assert reason in problem and "--config.batch_per_env=2" in problem
    config.batch_per_env = 2
    assert config_problems(config) == []


def test_mmd_gamma_zero_would_train_erm_under_another_label_and_is_refused():
    config = load("rotated_digits")
    config.objective, config.mmd_gamma = "coral", 0.0
    (problem,) = config_problems(config)
    assert problem.startswith("config.mmd_gamma=0.0: expected a number > 0")
    assert "ERM labelled CORAL or MMD" in problem


def test_swad_says_that_it_replaces_eval_every():
    config = load("rotated_digits")  # eval_every 50, swad_eval_every 100
    assert config_warnings(config) == []
    config.swad = True
    (warning,) = config_warnings(config)
    assert warning.startswith("config.eval_every=50 is not used with config.swad=True: ")
    assert "--config.swad_eval_every=50" in warning
    config.swad_eval_every = 50
    assert config_warnings(config) == []


# --- a method's own setting given while the method is not in the run -------------------


@pytest.mark.parametrize(
    "given,values,expected",
    [
        (
            {"miro_ld": 5.0},
            {},
            "--config.miro_ld=5.0: miro_ld is a hyperparameter of objective miro, not of this "
            "run's objective erm and update rule sagm; add --config.objective=miro, or leave "
            "--config.miro_ld out.",
        ),
        (
            {"mmd_gamma": 2.0},
            {"algorithm": "erm"},
            "of objectives coral, mmd, causirl_coral, causirl_mmd, not of this run's objective "
            "erm and update rule erm; add --config.objective=coral (or mmd, causirl_coral, "
            "causirl_mmd)",
        ),
        ({"alpha": 1e-3}, {"algorithm": "sam"}, "alpha is a hyperparameter of update rule sagm"),
        ({"rho": 0.1}, {"algorithm": "erm"}, "rho is a hyperparameter of update rules sam, gsam"),
        (
            {"disam_descent": "variance"},
            {},
            "--config.disam_descent=variance: DISAM's setting, and DISAM is off "
            "(config.disam_lambda=0); add --config.disam_lambda=",
        ),
        (
            {"swad_n_converge": 5},
            {},
            "--config.swad_n_converge=5: SWAD's setting, and SWAD is off; add --config.swad=True",
        ),
        (
            {"mixstyle_p": 1.0},
            {},
            "--config.mixstyle_p=1.0: MixStyle's setting, and MixStyle is off; add "
            "--config.mixstyle=True",
        ),
    ],
)
def test_a_setting_of_a_method_not_in_the_run_is_a_problem(given, values, expected):
    from sagm_jax.config import unused_setting_problems

    config = unlocked(**values, **given)
    (problem,) = unused_setting_problems(config, given)
    assert expected in problem, problem
    assert unused_setting_problems(config, ()) == []  # the config file's own values


@pytest.mark.parametrize(
    "given,values",
    [
        ({"miro_ld": 5.0}, {"objective": "miro"}),
        ({"mmd_gamma": 2.0}, {"objective": "mmd"}),
        ({"rho": 0.1, "alpha": 5e-4, "combine": "sum"}, {}),
        ({"disam_descent": "variance", "disam_lambda": 0.1}, {}),
        ({"swad_n_converge": 5}, {"swad": True}),
        ({"mixstyle_p": 1.0, "mixstyle_mix": "crossdomain"}, {"mixstyle": True}),
        ({"lr": 1e-4, "disam_lambda": 0.0, "swad": False, "objective": "erm"}, {}),
    ],
)
def test_a_setting_of_a_method_in_the_run_is_no_problem(given, values):
    from sagm_jax.config import unused_setting_problems

    assert unused_setting_problems(unlocked(**values, **given), given) == []


def test_the_sweeps_searches_give_no_method_a_setting_of_another():
    from sagm_jax.config import unused_setting_problems
    from sagm_jax.methods import OBJECTIVES, UPDATE_RULES
    from sagm_jax.sweep import hparams, jobs

    triples, _ = jobs.method_combinations(list(OBJECTIVES), list(UPDATE_RULES), [0.0, 0.1])
    for objective, algorithm, disam in triples:
        config = unlocked(objective=objective, algorithm=algorithm, disam_lambda=disam)
        for dataset in ("RotatedDigits", "PACS"):
            drawn = hparams.random_hparams(algorithm, dataset, 3, 0, objective, disam)
            assert unused_setting_problems(config, drawn) == [], (objective, algorithm)
        for grid in (jobs.REDUCED_RESNET, jobs.REDUCED_MNIST, jobs.SWAD_GRID):
            for point in jobs.grid_points(grid, algorithm, objective):
                assert unused_setting_problems(config, point) == [], (objective, algorithm)


@pytest.mark.parametrize(
    "dataset_file, preset, expected",
    [
        # khanrc/miro README, "Our searched HPs" (VLCS column).
        ("vlcs", "miro", dict(objective="miro", lr=1e-5, dropout=0.5, weight_decay=1e-6,
                              miro_ld=0.01)),
        # The README's "Pushing the limits" PACS and DomainNet commands (defaults lr 5e-5,
        # batch 16, SWAD on).
        ("pacs", "miro_swag", dict(objective="miro", arch="swag_regnety_16gf",
                                   batch_per_env=16, miro_ld=0.01, swad=True, lr=5e-5)),
        ("domain_net", "miro_swag", dict(miro_ld=0.1, swad_eval_every=500)),
        ("office_home", "miro_swad", dict(miro_ld=0.1, swad=True, batch_per_env=32)),
        # DomainBed HEAD's hparams_registry defaults: resnet50_augmix, freeze_bn False.
        ("terra_incognita", "domainbed_head", dict(arch="resnet50_augmix",
                                                   freeze_batchnorm=False, lr=5e-5,
                                                   batch_per_env=32, dropout=0.0,
                                                   weight_decay=0.0, algorithm="sagm")),
    ],
)
def test_a_config_preset_sets_the_published_protocol(dataset_file, preset, expected):
    config = runpy.run_path(f"configs/{dataset_file}.py")["get_config"](preset)
    assert {key: config[key] for key in expected} == expected
    assert not config_problems(config) or all(
        "pretrained_weights" in p or "data_dir" in p for p in config_problems(config))


def test_an_unknown_preset_is_refused_by_name():
    with pytest.raises(ValueError, match="'miro_swig'.*domainbed_head, miro, miro_swad"):
        runpy.run_path("configs/pacs.py")["get_config"]("miro_swig")


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(arch="clip_vit-b16", mixstyle=True), "MixStyle sits between the stages"),
        (dict(arch="swag_regnety_16gf", mixstyle=True), "has none"),
        (dict(arch="resnet50", attention_only=True), "config.arch=resnet50 has none"),
        (dict(arch="dinov2_vitb14", attention_only=True, algorithm="fish"), "procedure"),
        (dict(arch="clip_vit-b16", image_size=8), "patches"),
    ],
)
def test_what_a_backbone_cannot_do_is_refused_before_the_run(changes, needle):
    config = runpy.run_path("configs/pacs.py")["get_config"]()
    config.pretrained_weights = "none"
    config.update(changes)
    assert any(needle in problem for problem in config_problems(config)), config_problems(config)
