"""sagm_jax.methods: the one table of objectives and update rules, read by the config,
the README and the run labels."""

import os

import pytest

from sagm_jax import methods
from sagm_jax.config import base_config, config_problems, mnist_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def problems_of(**overrides):
    config = mnist_config("RotatedDigits")
    config.update(overrides)
    return config_problems(config)


def test_every_method_hyperparameter_is_a_config_field_with_its_default():
    config = base_config()
    for hp in methods.hyperparameters():
        assert config[hp.key] == hp.default, hp.key
    assert config.objective == "erm" and config.disam_lambda == 0.0
    assert set(methods.OBJECTIVES) >= {"erm", "mixup", "cutmix", "coral", "mmd", "groupdro",
                                       "irm", "vrex"}
    assert set(methods.UPDATE_RULES) >= {"erm", "sam", "gsam", "sagm", "erm_sam", "fish",
                                         "and_mask", "mldg"}


@pytest.mark.parametrize(
    "key,bad,expected",
    [
        ("mixup_alpha", 0.0, "a number > 0"),
        ("irm_penalty_anneal_iters", -1, "an integer >= 0"),
        ("and_mask_tau", 1.5, "in [0, 1]"),
        ("fish_meta_lr", 0.0, "in (0, 1]"),
        ("disam_lambda", -1.0, "a number >= 0"),
        ("objective", "dann", "one of erm, mixup"),
        ("algorithm", "fishy", "one of erm, sam, gsam, sagm, erm_sam, fish"),
    ],
)
def test_a_bad_method_value_is_named_with_what_was_expected(key, bad, expected):
    found = [p for p in problems_of(**{key: bad}) if p.startswith(f"config.{key}=")]
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    "overrides,words",
    [
        (dict(algorithm="fish", objective="coral"), ["fish", "objective erm only"]),
        (dict(algorithm="erm", disam_lambda=0.1), ["disam_lambda=0.1", "sam, gsam or sagm"]),
        (dict(algorithm="mldg", disam_lambda=0.1), ["disam_lambda=0.1"]),
        (dict(objective="coral", perturbation="per_device"), ["per_device", "global"]),
        (dict(algorithm="and_mask", freeze_batchnorm=False), ["freeze_batchnorm=True"]),
    ],
)
def test_combinations_that_are_not_a_method_are_refused_in_one_line(overrides, words):
    found = problems_of(**overrides)
    assert len(found) == 1, found
    assert all(word in found[0] for word in words), found[0]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(objective="coral", algorithm="sagm", disam_lambda=0.1),
        dict(objective="mixup", algorithm="gsam"),
        dict(objective="irm", algorithm="sam", disam_lambda=0.5),
        dict(objective="erm", algorithm="fish"),
        dict(objective="groupdro", algorithm="erm"),
    ],
)
def test_objectives_compose_with_every_plain_and_sharpness_aware_rule(overrides):
    assert problems_of(**overrides) == []


@pytest.mark.parametrize(
    "objective,algorithm,disam,label",
    [
        ("erm", "sagm", 0.0, "SAGM"),
        ("erm", "erm", 0.0, "ERM"),
        ("mixup", "erm", 0.0, "ERM + Mixup"),
        ("cutmix", "erm", 0.0, "ERM + CutMix"),
        ("coral", "erm", 0.0, "CORAL"),
        ("coral", "sagm", 0.0, "SAGM + CORAL"),
        ("erm", "sagm", 0.1, "DISAM on SAGM"),
        ("coral", "sagm", 0.1, "DISAM on SAGM + CORAL"),
        ("erm", "and_mask", 0.0, "AND-mask"),
    ],
)
def test_method_labels_are_the_papers_row_names(objective, algorithm, disam, label):
    assert methods.method_label(objective, algorithm, disam) == label
    if label in methods.DISAM_PUBLISHED:  # the published rows carry exactly these names
        assert methods.DISAM_PUBLISHED[label][-1] == "DISAM paper"


@pytest.mark.parametrize(
    "member, averaging, label",
    [
        ("ERM", "diwa_uniform", "DiWA (uniform)"),
        ("ERM", "DiWA (greedy)", "DiWA (greedy)"),
        ("ERM", "ratatouille_uniform", "Ratatouille (uniform)"),
        ("ERM", "ratatouille_greedy", "Ratatouille (greedy)"),
        ("ERM", "eoa", "EoA"),
        ("ERM", "erm_plusplus", "ERM++"),
        ("SAGM", "diwa_uniform", "SAGM + DiWA (uniform)"),
        ("SAGM + CORAL", "EoA", "SAGM + CORAL + EoA"),
        ("ERM + SWAD", "diwa_greedy", "ERM + SWAD + DiWA (greedy)"),
        ("DISAM on SAGM", "ratatouille_greedy", "DISAM on SAGM + Ratatouille (greedy)"),
    ],
)
def test_averaging_labels_name_the_members_method_then_the_averaging(member, averaging, label):
    assert methods.averaging_label(member, averaging) == label


def test_the_methods_table_holds_the_averagings_published_rows():
    """The per-dataset figures (PACS / VLCS / OfficeHome / TerraInc / DomainNet / avg) as
    the DiWA README (alexrame/diwa: its "LP" init rows "Uniform", "Restricted" and
    "DiWA† Uniform") and the Model Ratatouille README (facebookresearch/ModelRatatouille:
    "Uniform", "Greedy", "Uniform†") print them; none for EoA and ERM++, whose READMEs
    print no figure as text."""
    printed = {
        "DiWA (uniform)": "88.7 / 78.4 / 72.1 / 51.4 / 47.4 / 67.6",
        "DiWA (greedy)": "88.0 / 78.5 / 71.5 / 51.6 / 47.7 / 67.5",
        "DiWA (uniform, 3 splits)": "89.0 / 78.6 / 72.8 / 51.9 / 47.7 / 68.0",
        "Ratatouille (uniform)": "89.5 / 78.5 / 73.1 / 51.8 / 47.5 / 68.1",
        "Ratatouille (greedy)": "90.5 / 78.7 / 73.4 / 49.2 / 47.7 / 67.9",
        "Ratatouille (uniform, 3 splits)": "89.8 / 78.3 / 73.5 / 52.0 / 47.7 / 68.3",
        "EoA": "- / - / - / - / - / -",
        "ERM++": "- / - / - / - / - / -",
    }
    lines = {line.split(" | ")[0][2:]: line for line in methods.markdown_table().splitlines()}
    for row, figures in printed.items():
        assert lines[row].endswith(f"| {figures} ({methods.published()[row][6]}) |"), row
    for label in methods.AVERAGINGS.values():  # every averaging has its published row
        assert label in printed
    assert "DiWA README, restricted" in methods.published()["DiWA (greedy)"][6]
    assert "uniform†" in methods.published()["Ratatouille (uniform, 3 splits)"][6]


@pytest.mark.parametrize("member, averaging, words", [
    ("SAGM", "soup", ["'soup'", "diwa_uniform", "DiWA (uniform)"]),
    ("", "eoa", ["member label ''", "method_label"]),
])
def test_a_bad_averaging_or_member_label_is_named(member, averaging, words):
    with pytest.raises(ValueError) as error:
        methods.averaging_label(member, averaging)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_domainbed_distributions_draw_inside_their_stated_ranges():
    import numpy as np

    rng = np.random.RandomState(0)
    for hp in methods.hyperparameters():
        if hp.distribution is None:
            continue
        for _ in range(50):
            value = hp.distribution.draw(rng)
            text = hp.distribution.text
            if "^U(" in text:  # 10^U(a,b), int(10^U(a,b)), int(2^U(a,b))
                base = float(text.removeprefix("int(").split("^")[0])
                low, high = (float(v) for v in text.split("U(")[1].rstrip(")").split(","))
                assert base**low - 1 <= value <= base**high, (hp.key, value)
            elif text.removeprefix("int(").startswith("U("):  # U(a,b), int(U(a,b))
                bounds = text.removeprefix("int(").removeprefix("U(").rstrip(")")
                low, high = (float(v) for v in bounds.split(","))
                assert low <= value <= high, (hp.key, value)
            else:  # a choice or fixed value; a boolean as Python writes it
                shown = str(value) if isinstance(value, (bool, str)) else f"{value:g}"
                assert shown in text, (hp.key, value)


def test_the_methods_page_lists_every_method_as_the_tables_say():
    with open(os.path.join(REPO, "docs", "methods.md")) as f:
        page = f.read()
    assert methods.markdown_table() in page


def test_mixstyles_probability_and_beta_reach_the_network(monkeypatch):
    from sagm_jax import models

    built = {}

    class Built(Exception):
        pass

    def create(*args, **kwargs):
        built.update(kwargs)
        raise Built  # the network's constructor arguments are what this test checks

    monkeypatch.setattr(models, "create", create)
    config = base_config()
    config.update(dict(arch="resnet18", mixstyle=True, mixstyle_p=1.0, mixstyle_alpha=0.3))
    with pytest.raises(Built):
        models.from_config(config, 2, (32, 32, 3), None)
    assert (built["mixstyle_p"], built["mixstyle_alpha"]) == (1.0, 0.3)
    # ... and the ResNet gives them to each of its MixStyle layers (traced, not compiled).
    import jax

    from sagm_jax.models import mixstyle, resnet

    layers = []

    class RecordedMixStyle(mixstyle.MixStyle):
        def __call__(self, x, active):
            layers.append((self.p, self.alpha))
            return super().__call__(x, active)

    monkeypatch.setattr(resnet, "MixStyle", RecordedMixStyle)
    network = resnet.ResNet("resnet18", 2, mixstyle_after=(1, 3), mixstyle_p=1.0,
                            mixstyle_alpha=0.3)
    jax.eval_shape(
        lambda key, x: network.init(key, x, train=False), jax.random.key(0), jax.numpy.ones((2, 32, 32, 3))
    )
    assert layers == [(1.0, 0.3), (1.0, 0.3)]


def test_the_methods_benchmark_knows_every_registered_methods_passes():
    """experiments/bench_methods.py divides each step's time by its predicted passes:
    a registered method without an entry there would stop the benchmark at its row."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "bench_methods.py")
    spec = importlib.util.spec_from_file_location("bench_methods", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = {bench.method_name(*pair) for pair in bench.methods()}
    assert names - set(bench.PASSES) == set()


# DomainBed HEAD's ``ALGORITHMS`` (``domainbed/algorithms.py``) that run here, by our flag:
# a record's ``args.algorithm`` is the class name, so DomainBed's collect_results reads a
# run of ours as a row of its own method.
DOMAINBED_CLASSES = {
    ("erm", "erm"): "ERM", ("mixup", "erm"): "Mixup", ("coral", "erm"): "CORAL",
    ("mmd", "erm"): "MMD", ("groupdro", "erm"): "GroupDRO", ("irm", "erm"): "IRM",
    ("vrex", "erm"): "VREx", ("rsc", "erm"): "RSC", ("selfreg", "erm"): "SelfReg",
    ("arm", "erm"): "ARM", ("mtl", "erm"): "MTL", ("sd", "erm"): "SD",
    ("causirl_coral", "erm"): "CausIRL_CORAL", ("causirl_mmd", "erm"): "CausIRL_MMD",
    ("ib_erm", "erm"): "IB_ERM", ("ib_irm", "erm"): "IB_IRM", ("cad", "erm"): "CAD",
    ("condcad", "erm"): "CondCAD", ("fishr", "erm"): "Fishr", ("eqrm", "erm"): "EQRM",
    ("iga", "erm"): "IGA", ("rdm", "erm"): "RDM", ("erm", "fish"): "Fish",
    ("erm", "and_mask"): "ANDMask", ("erm", "sand_mask"): "SANDMask", ("erm", "mldg"): "MLDG",
    ("erm", "dann"): "DANN", ("erm", "cdann"): "CDANN", ("erm", "sagnet"): "SagNet",
    ("erm", "trm"): "TRM", ("erm", "transfer"): "Transfer", ("erm", "adrmx"): "ADRMX",
    ("erm", "urm"): "URM",
}


def test_records_name_each_domainbed_method_by_its_class():
    from sagm_jax.training.rundir import record_algorithm

    got = {pair: record_algorithm({"objective": pair[0], "algorithm": pair[1]})
           for pair in DOMAINBED_CLASSES}
    assert got == DOMAINBED_CLASSES
