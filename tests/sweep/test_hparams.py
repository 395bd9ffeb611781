"""sagm_jax.sweep.hparams.random_hparams against a re-statement of DomainBed's
``hparams_registry`` written here: ``misc.seed_hash`` as md5 of ``str`` of the argument
tuple, one numpy ``RandomState(seed_hash(seed_hash(hparams_seed, trial_seed), name))`` per
DomainBed name, each distribution's formula written out; then mapped to our config keys.
Several algorithms (erm, coral, mixup, irm, fish, and_mask, mldg, sagm), datasets (PACS,
DomainNet, RotatedMNIST, and our RotatedDigits with MNIST's) and seeds; setting 0 is
DomainBed's defaults."""

import collections
import hashlib
import itertools

import numpy as np
import pytest

from sagm_jax.sweep.hparams import random_hparams, seed_hash

SMALL_IMAGES = ("Debug28", "RotatedMNIST", "ColoredMNIST")


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def reference_registry(random_seed):
    """A DomainBed-style ``_hparams`` registry (DomainBed's and its forks', e.g.
    alexrame/diwa's): ``hparams`` and its ``_hparam``, each name drawn from
    ``RandomState(seed_hash(random_seed, name))``, with the unconditional names."""
    hparams = {}

    def _hparam(name, default_val, random_val_fn):
        assert name not in hparams
        random_state = np.random.RandomState(db_seed_hash(random_seed, name))
        hparams[name] = (default_val, random_val_fn(random_state))

    _hparam("data_augmentation", True, lambda r: True)
    _hparam("resnet18", False, lambda r: False)
    _hparam("resnet_dropout", 0.0, lambda r: r.choice([0.0, 0.1, 0.5]))
    _hparam("class_balanced", False, lambda r: False)
    _hparam("nonlinear_classifier", False, lambda r: bool(r.choice([False, False])))
    return hparams, _hparam


def db_hparams(algorithm, dataset, random_seed):
    """DomainBed's ``_hparams``: ``{name: (default, random value)}``."""
    hparams, _hparam = reference_registry(random_seed)
    if algorithm == "IRM":
        _hparam("irm_lambda", 1e2, lambda r: 10 ** r.uniform(-1, 5))
        _hparam("irm_penalty_anneal_iters", 500, lambda r: int(10 ** r.uniform(0, 4)))
    elif algorithm == "Mixup":
        _hparam("mixup_alpha", 0.2, lambda r: 10 ** r.uniform(-1, 1))
    elif algorithm in ("MMD", "CORAL"):
        _hparam("mmd_gamma", 1.0, lambda r: 10 ** r.uniform(-1, 1))
    elif algorithm == "MLDG":
        _hparam("mldg_beta", 1.0, lambda r: 10 ** r.uniform(-1, 1))
        _hparam("n_meta_test", 2, lambda r: r.choice([1, 2]))
    elif algorithm == "Fish":
        _hparam("meta_lr", 0.5, lambda r: r.choice([0.05, 0.1, 0.5]))
    elif algorithm == "ANDMask":
        _hparam("tau", 1, lambda r: r.uniform(0.5, 1.0))
    # Dataset-dependent, defined after the algorithm's in DomainBed (order is irrelevant).
    if dataset in SMALL_IMAGES:
        _hparam("lr", 1e-3, lambda r: 10 ** r.uniform(-4.5, -2.5))
        _hparam("weight_decay", 0.0, lambda r: 0.0)
        _hparam("batch_size", 64, lambda r: int(2 ** r.uniform(3, 9)))
    else:
        _hparam("lr", 5e-5, lambda r: 10 ** r.uniform(-5, -3.5))
        _hparam("weight_decay", 0.0, lambda r: 10 ** r.uniform(-6, -2))
        big = 5 if dataset == "DomainNet" else 5.5
        _hparam("batch_size", 32, lambda r: int(2 ** r.uniform(3, big)))
    return hparams


def db_setting(algorithm, dataset, hparams_seed, trial_seed):
    """DomainBed's train.py: defaults at hparams_seed 0, else the random values of
    ``seed_hash(hparams_seed, trial_seed)``."""
    table = db_hparams(algorithm, dataset, db_seed_hash(hparams_seed, trial_seed))
    return {name: pair[0] if hparams_seed == 0 else pair[1] for name, pair in table.items()}


# Our (algorithm, objective) of each DomainBed algorithm, and DomainBed's name of each
# of our keys.
OURS = {
    "ERM": ("erm", "erm"),
    "CORAL": ("erm", "coral"),
    "Mixup": ("erm", "mixup"),
    "IRM": ("erm", "irm"),
    "Fish": ("fish", "erm"),
    "ANDMask": ("and_mask", "erm"),
    "MLDG": ("mldg", "erm"),
}
OUR_KEYS = {
    "lr": "lr",
    "batch_size": "batch_per_env",
    "weight_decay": "weight_decay",
    "resnet_dropout": "dropout",
    "irm_lambda": "irm_lambda",
    "irm_penalty_anneal_iters": "irm_penalty_anneal_iters",
    "mixup_alpha": "mixup_alpha",
    "mmd_gamma": "mmd_gamma",
    "mldg_beta": "mldg_beta",
    "n_meta_test": "mldg_n_meta_test",
    "meta_lr": "fish_meta_lr",
    "tau": "and_mask_tau",
}
DATASETS = ("PACS", "DomainNet", "RotatedMNIST")
SEEDS = [(h, t) for h in (0, 1, 2, 7, 19) for t in (0, 1, 2)]


def expected_ours(db_algorithm, dataset, hparams_seed, trial_seed):
    """DomainBed's setting in our keys; the MNIST CNN takes no dropout."""
    values = db_setting(db_algorithm, dataset, hparams_seed, trial_seed)
    expected = {OUR_KEYS[name]: v for name, v in values.items() if name in OUR_KEYS}
    if dataset in SMALL_IMAGES:
        del expected["dropout"]
    return expected


@pytest.mark.parametrize("db_algorithm", sorted(OURS))
def test_draws_are_domainbeds(db_algorithm):
    algorithm, objective = OURS[db_algorithm]
    for dataset, (hparams_seed, trial_seed) in itertools.product(DATASETS, SEEDS):
        got = random_hparams(algorithm, dataset, hparams_seed, trial_seed, objective)
        want = expected_ours(db_algorithm, dataset, hparams_seed, trial_seed)
        assert got == want, (dataset, hparams_seed, trial_seed)
        assert all(type(v) in (int, float) for v in got.values())  # JSON and flags


def test_setting_zero_is_domainbeds_defaults_not_the_config_files():
    assert random_hparams("erm", "PACS", 0, 2) == {
        "lr": 5e-5, "batch_per_env": 32, "weight_decay": 0.0, "dropout": 0.0
    }
    assert random_hparams("mldg", "RotatedMNIST", 0, 1) == {
        "lr": 1e-3, "batch_per_env": 64, "weight_decay": 0.0,
        "mldg_beta": 1.0, "mldg_n_meta_test": 2,
    }


def test_draws_change_with_the_trial_seed_and_mnist_is_drawn_as_domainbed_draws_it():
    pacs = [random_hparams("erm", "PACS", 3, t)["lr"] for t in range(3)]
    assert len(set(pacs)) == 3
    mnist = random_hparams("erm", "RotatedMNIST", 3, 0)
    assert 10**-4.5 <= mnist["lr"] <= 10**-2.5 and mnist["weight_decay"] == 0.0
    assert 8 <= mnist["batch_per_env"] < 512 and "dropout" not in mnist
    # RotatedDigits runs the same CNN: MNIST's distributions, the same seeding.
    assert random_hparams("erm", "RotatedDigits", 3, 0) == mnist


def test_seed_hash_is_str_of_the_argument_tuple():
    assert seed_hash(3, 0) == int(hashlib.md5(b"(3, 0)").hexdigest(), 16) % 2**31
    assert seed_hash(5, "lr") == int(hashlib.md5(b"(5, 'lr')").hexdigest(), 16) % 2**31


def our_heads(dataset, hparams_seed, trial_seed, alpha_draw=True):
    """Our heads' definition: rho fixed 0.05; SAGM's alpha the first
    RandomState(seed_hash(s, 'alpha')).choice of {1e-3, 5e-4} (default 1e-3)."""
    expected = {**expected_ours("ERM", dataset, hparams_seed, trial_seed), "rho": 0.05}
    if alpha_draw:
        rng = np.random.RandomState(db_seed_hash(db_seed_hash(hparams_seed, trial_seed), "alpha"))
        alpha = float(rng.choice([1e-3, 5e-4]))
        expected["alpha"] = 1e-3 if hparams_seed == 0 else alpha
    return expected


def test_sharpness_aware_heads_draw_ours_on_domainbeds_shared_draws():
    for dataset, (hparams_seed, trial_seed) in itertools.product(DATASETS, SEEDS):
        assert random_hparams("sagm", dataset, hparams_seed, trial_seed) == our_heads(
            dataset, hparams_seed, trial_seed
        )
        assert random_hparams("sam", dataset, hparams_seed, trial_seed) == our_heads(
            dataset, hparams_seed, trial_seed, alpha_draw=False
        )
    alphas = {random_hparams("sagm", "PACS", h, 0)["alpha"] for h in range(1, 20)}
    assert alphas == {1e-3, 5e-4}
    assert random_hparams("gsam", "PACS", 4, 1)["gsam_alpha"] == 0.01
    assert "alpha" not in random_hparams("erm_sam", "PACS", 4, 1)  # alpha 0 by definition
    # SAGM + CORAL: the head's and the objective's, each seeded under its own name.
    both = random_hparams("sagm", "PACS", 4, 1, objective="coral")
    gamma = expected_ours("CORAL", "PACS", 4, 1)["mmd_gamma"]
    assert both == {**our_heads("PACS", 4, 1), "mmd_gamma": gamma}


def test_disam_lambda_is_drawn_when_disam_is_on():
    assert "disam_lambda" not in random_hparams("sagm", "PACS", 2, 0)
    assert random_hparams("sagm", "PACS", 0, 0, disam_lambda=0.3)["disam_lambda"] == 0.3
    rng = np.random.RandomState(db_seed_hash(db_seed_hash(2, 1), "disam_lambda"))
    drawn = random_hparams("sagm", "PACS", 2, 1, disam_lambda=0.3)["disam_lambda"]
    assert drawn == 10 ** rng.uniform(-2, 0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="objective erm only"):
        random_hparams("fish", "PACS", 1, 0, objective="coral")
    with pytest.raises(ValueError, match="algorithm 'irm'"):
        random_hparams("irm", "PACS", 1, 0)
    with pytest.raises(ValueError, match="hparams_seed -1"):
        random_hparams("erm", "PACS", -1, 0)
    with pytest.raises(ValueError, match="Unknown dataset"):
        random_hparams("erm", "Nope", 1, 0)


def test_arm_batch_is_domainbeds_fixed_8_on_image_datasets():
    """DomainBed's ``hparams_registry``: ARM's ``batch_size`` is 8, default and every draw,
    on the datasets outside SMALL_IMAGES (DomainNet included); on the MNIST-like ones ARM
    draws the shared int(2^U(3, 9)), as every method."""
    for dataset in ("PACS", "VLCS", "OfficeHome", "TerraIncognita", "DomainNet"):
        for seed in range(6):
            for trial in range(2):
                arm = random_hparams("erm", dataset, seed, trial, objective="arm")
                assert arm["batch_per_env"] == 8, (dataset, seed, trial)
    for seed in range(6):
        arm = random_hparams("erm", "RotatedDigits", seed, 0, objective="arm")
        erm = random_hparams("erm", "RotatedDigits", seed, 0)
        assert arm["batch_per_env"] == erm["batch_per_env"]
    assert random_hparams("erm", "PACS", 3, 0)["batch_per_env"] != 8  # others draw it


def test_eval_batch_default_is_the_declared_reference_batch():
    """``eval_batch_size`` 0: ARM's and MTL's reference batch (DomainBed's 64), the
    throughput default (128 per CPU device) for a network that predicts per example; a
    set value wins."""
    import types

    from sagm_jax import methods
    from sagm_jax.methods import networks
    from sagm_jax.training.evaluation import batch_size

    config = types.SimpleNamespace(eval_batch_size=0)
    for name in ("arm", "mtl"):
        model = networks.MethodModel(None, methods.objective(name).network, {})
        assert batch_size(config, 1, "cpu", model) == 64
        assert batch_size(types.SimpleNamespace(eval_batch_size=16), 1, "cpu", model) == 16
    assert batch_size(config, 1, "cpu", object()) == 128


def test_a_vit_draws_its_dropout_as_domainbeds_vit_dropout():
    """DomainBed HEAD's hparams_registry draws ``vit_dropout`` (choice {0, 0.1, 0.5}) from
    its own generator, seeded by md5 of str((seed_hash(hparams_seed, trial_seed),
    'vit_dropout')); a ResNet's dropout stays ``resnet_dropout``'s draw."""

    def md5_seed(*args):
        return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % 2**31

    differ = 0
    for hparams_seed in range(1, 9):
        setting = md5_seed(hparams_seed, 0)
        expected = {
            name: np.random.RandomState(md5_seed(setting, name)).choice([0.0, 0.1, 0.5])
            for name in ("vit_dropout", "resnet_dropout")
        }
        vit = random_hparams("sagm", "PACS", hparams_seed, 0, arch="dinov2_vitb14")
        resnet = random_hparams("sagm", "PACS", hparams_seed, 0, arch="resnet50")
        assert vit["dropout"] == expected["vit_dropout"]
        assert resnet["dropout"] == expected["resnet_dropout"]
        assert {k: v for k, v in vit.items() if k != "dropout"} == {
            k: v for k, v in resnet.items() if k != "dropout"}
        differ += vit["dropout"] != resnet["dropout"]
    assert differ  # the two names draw different values for some settings


def diwa_setting(algorithm, dataset, hparams_seed, trial_seed):
    """alexrame/diwa's ``hparams_registry._hparams`` (its ``## DiWA ##`` block replaces the
    dataset-dependent lr, weight_decay and batch_size on every dataset) as its
    ``train.py`` calls it: defaults at hparams_seed 0, else the random values of
    ``seed_hash(hparams_seed, trial_seed)``."""
    hparams, _hparam = reference_registry(db_seed_hash(hparams_seed, trial_seed))
    if algorithm in ("MMD", "CORAL"):
        _hparam("mmd_gamma", 1.0, lambda r: 10 ** r.uniform(-1, 1))
    _hparam("lr", 5e-5, lambda r: r.choice([1e-5, 3e-5, 5e-5]))
    _hparam("weight_decay", 0, lambda r: r.choice([1e-4, 1e-6]))
    _hparam("batch_size", 32, lambda r: 32)
    values = {name: pair[0] if hparams_seed == 0 else pair[1] for name, pair in hparams.items()}
    expected = {OUR_KEYS[name]: v for name, v in values.items() if name in OUR_KEYS}
    if dataset in SMALL_IMAGES:
        del expected["dropout"]  # the MNIST CNN has none
    return expected


@pytest.mark.parametrize("db_algorithm", ["ERM", "CORAL"])
def test_diwa_space_draws_the_references_mild_ranges(db_algorithm):
    from sagm_jax.sweep.hparams import diwa_hparams

    algorithm, objective = OURS[db_algorithm]
    seen = collections.defaultdict(set)
    for dataset, (hparams_seed, trial_seed) in itertools.product(DATASETS, SEEDS):
        want = diwa_setting(db_algorithm, dataset, hparams_seed, trial_seed)
        got = diwa_hparams(dataset, hparams_seed, trial_seed, algorithm, objective)
        assert got == want, (dataset, hparams_seed, trial_seed)
        assert got == random_hparams(algorithm, dataset, hparams_seed, trial_seed, objective,
                                     space="diwa")
        for key in ("lr", "weight_decay", "dropout"):
            seen[key].add(got.get(key))
    assert seen["lr"] == {1e-5, 3e-5, 5e-5} and seen["weight_decay"] == {0.0, 1e-4, 1e-6}
    assert diwa_hparams("PACS", 0, 1) == {
        "lr": 5e-5, "batch_per_env": 32, "weight_decay": 0.0, "dropout": 0.0
    }


def test_diwa_space_keeps_the_methods_own_draws_and_refuses_an_unknown_space():
    from sagm_jax.sweep.hparams import diwa_hparams

    drawn = diwa_hparams("PACS", 4, 1, algorithm="sagm")
    assert drawn == {**diwa_setting("ERM", "PACS", 4, 1), **{
        k: v for k, v in our_heads("PACS", 4, 1).items() if k in ("rho", "alpha")
    }}
    # ARM's fixed batch of 8 is DomainBed's; DiWA's registry fixes 32 for every method.
    assert diwa_hparams("PACS", 4, 1, objective="arm")["batch_per_env"] == 32
    with pytest.raises(ValueError, match="space .soup.: expected one of domainbed, diwa, eoa"):
        random_hparams("erm", "PACS", 1, 0, space="soup")


def eoa_setting(dataset, hparams_seed, trial_seed):
    """salesforce/ensemble-of-averages ``hparams_registry._hparams`` for ERM_SMA: DomainBed's
    shared names, then its "hyper-params used in our experiments" (batch_size and lr fixed,
    weight_decay re-drawn 10^U(-6, -4)) on every dataset."""
    random_seed = db_seed_hash(hparams_seed, trial_seed)

    def draw(name, default_val, random_val_fn):
        value = random_val_fn(np.random.RandomState(db_seed_hash(random_seed, name)))
        return default_val if hparams_seed == 0 else value

    expected = {
        "lr": draw("lr", 5e-5, lambda r: 5e-5),
        "batch_per_env": draw("batch_size", 32, lambda r: 32),
        "weight_decay": draw("weight_decay", 0.0, lambda r: 10 ** r.uniform(-6, -4)),
        "dropout": draw("resnet_dropout", 0.0, lambda r: r.choice([0.0, 0.1, 0.5])),
    }
    if dataset in SMALL_IMAGES:
        del expected["dropout"]  # the MNIST CNN has none
    return expected


def test_eoa_space_draws_the_references_experiment_ranges():
    for dataset, (hparams_seed, trial_seed) in itertools.product(DATASETS, SEEDS):
        got = random_hparams("erm", dataset, hparams_seed, trial_seed, space="eoa")
        assert got == eoa_setting(dataset, hparams_seed, trial_seed), (dataset, hparams_seed)
