"""Adding a method is one function and one registry entry (docs/methods.md, "Adding a
method"): a sharpness-aware rule (SAM at half the radius), an objective (label smoothing)
and a procedure (Adam on the mean of the domain gradients) are registered here through
``methods.register_update_rule`` / ``methods.register_objective``, then seen by the
config's fields and checks, the sweep's choices and random search, the tables' labels and
the README's methods table, and trained through the command line's path
(``cli.preflight``, then ``train.train_and_evaluate``). Each new method is checked
against a built-in one that computes the same thing: SAM at half the radius of rho equals
SAM at rho/2, smoothing 0 equals ERM, the mean of the domain gradients equals ERM's
gradient of the concatenated batch (equal domain minibatches, no dropout)."""

import json

import jax
import jax.numpy as jnp
import pytest

import sagm_jax
from run_fixtures import digits_config
from sagm_jax import cli, config as config_lib, methods
from sagm_jax.methods import objectives, procedures, update_rules
from sagm_jax.results import collect
from sagm_jax.sweep import hparams
from sagm_jax.sweep.__main__ import make_jobs, parse_args
from sagm_jax.training.train import train_and_evaluate


# --- the three new methods, each one function and one entry ---------------------------


def half_radius_sam(hp, **common):
    """SAM whose perturbation has half the radius ``rho``."""
    return [sagm_jax.sam(hp["rho"] / 2, **common)]


HALF_SAM = methods.UpdateRule(
    methods.Method("half_sam", "SAM/2", (update_rules.RHO_HYPERPARAMETER,),
                   "SAM at half the radius", "a test"),
    "head", half_radius_sam, disam=True,
)


def smoothed_cross_entropy(step: objectives.Step):
    """Label smoothing: the cross-entropy against (1 - eps) one_hot(y) + eps / C."""
    out = step.forward(step.images)
    log_p = jax.nn.log_softmax(out.logits.astype(jnp.float32))
    eps, classes = step.hp["smoothing"], log_p.shape[-1]
    target = (1 - eps) * jax.nn.one_hot(step.labels, classes) + eps / classes
    losses = objectives.by_domain(-(target * log_p).sum(-1), step.num_domains).mean(1)
    loss = losses.mean()
    return loss, objectives.make_aux(step, out, {"loss": loss}, losses)


SMOOTHED = methods.Objective(
    methods.Method("smoothed", "Smoothing", (
        methods.Hyperparameter("smoothing", 0.1, "label smoothing's eps", "[0, 1)",
                               methods.uniform(0, 0.2)),
    ), "cross-entropy against smoothed labels", "a test"),
    smoothed_cross_entropy,
)


def domain_mean_procedure(hp, *, learning_rate, weight_decay, num_domains):
    """Adam on ``scale`` times the mean of the per-domain gradients."""
    adam = procedures.torch_adam(learning_rate, weight_decay)

    def update(params, state, domain_value_and_grad, key):
        pairs = [domain_value_and_grad(params, m) for m in range(num_domains)]
        grads = jax.tree.map(lambda *g: hp["scale"] * sum(g) / num_domains,
                             *(g for _, g in pairs))
        updates, state = adam.update(grads, state, params)
        return updates, state, {"loss": sum(loss for loss, _ in pairs) / num_domains}

    return procedures.Procedure(adam.init, update)


DOMAIN_MEAN = methods.UpdateRule(
    methods.Method("domain_mean", "Domain mean", (
        methods.Hyperparameter("scale", 1.0, "factor of the mean gradient", "> 0"),
    ), "Adam on the mean of the domain gradients", "a test"),
    "procedure", domain_mean_procedure,
)


@pytest.fixture
def registered():
    """The three methods registered; the registries as the package filled them after."""
    saved = dict(methods.OBJECTIVES), dict(methods.UPDATE_RULES)
    methods.register_update_rule(HALF_SAM)
    methods.register_objective(SMOOTHED)
    methods.register_update_rule(DOMAIN_MEAN)
    yield
    for table, entries in zip((methods.OBJECTIVES, methods.UPDATE_RULES), saved):
        table.clear()
        table.update(entries)


# --- what reads the registries sees them ------------------------------------------------


def test_the_config_its_checks_and_help_see_new_methods(registered):
    config = digits_config(algorithm="half_sam", objective="smoothed")
    assert config.smoothing == 0.1 and config.scale == 1.0
    assert config_lib.section(config, "method")["smoothing"] == 0.1
    assert config_lib.config_problems(config) == []
    config.update(smoothing=1.5, algorithm="domain_mean", rho=0.0)
    assert config_lib.config_problems(config) == [
        "config.smoothing=1.5: expected a number in [0, 1).",
        "config.algorithm=domain_mean with config.objective=smoothed: domain_mean is its own "
        "update from its own losses (DomainBed's), so it takes objective erm only; use "
        "--config.objective=erm, or an update rule among erm, sam, gsam, sagm, erm_sam, "
        "half_sam.",
    ]
    config.update(algorithm="half_sam", objective="erm", smoothing=0.1)  # rho 0 with a head
    assert config_lib.config_problems(config) == [
        "config.rho=0.0: expected a number > 0: with rho 0, algorithm=half_sam does not perturb."
    ]
    help_text = cli.help_text()
    assert "--config.smoothing=0.1" in help_text and "label smoothing's eps" in help_text
    assert "half_sam" in help_text and "domain_mean" in help_text


def test_the_sweep_and_the_random_search_see_new_methods(registered, tmp_path):
    argv = ["launch", "--datasets", "RotatedDigits", "--test_envs", "0", "--output_dir",
            str(tmp_path), "--algorithms", "half_sam", "domain_mean", "sagm",
            "--objectives", "erm", "smoothed", "--hparams", "random", "--n_hparams", "2"]
    jobs = make_jobs(parse_args(argv))
    made = {(j.args["algorithm"], j.args.get("objective", "erm")) for j in jobs}
    # domain_mean, a procedure, takes objective erm only; the others take both.
    assert made == {("half_sam", "erm"), ("half_sam", "smoothed"), ("domain_mean", "erm"),
                    ("sagm", "erm"), ("sagm", "smoothed")}
    drawn = hparams.random_hparams("half_sam", "RotatedDigits", 1, 0, objective="smoothed")
    assert drawn["rho"] == update_rules.RHO and 0 <= drawn["smoothing"] <= 0.2
    assert hparams.random_hparams("domain_mean", "RotatedDigits", 0, 0) == {
        "lr": 1e-3, "batch_per_env": 64, "weight_decay": 0.0  # scale has no distribution
    }


def test_labels_and_the_methods_table_see_new_methods(registered):
    assert methods.method_label("smoothed", "half_sam") == "SAM/2 + Smoothing"
    assert methods.method_label("smoothed", "erm") == "ERM + Smoothing"
    assert methods.method_label("erm", "half_sam", 0.1) == "DISAM on SAM/2"
    table = methods.markdown_table()
    assert "| SAM/2 | `algorithm=half_sam` | `rho` 0.05 (0.05) | a test | - |" in table
    assert "| Smoothing | `objective=smoothed` | `smoothing` 0.1 (U(0,0.2)) |" in table
    assert "| Domain mean | `algorithm=domain_mean` | `scale` 1 | a test | - |" in table


def test_a_registration_that_would_break_a_table_is_refused(registered):
    with pytest.raises(ValueError, match="update rule 'half_sam' is registered already"):
        methods.register_update_rule(HALF_SAM)
    clash = HALF_SAM._replace(method=HALF_SAM.method._replace(
        name="other_sam", hyperparameters=(update_rules.RHO_HYPERPARAMETER._replace(default=1.0),)
    ))
    with pytest.raises(ValueError, match="'rho' .* differs from the one sam, gsam, sagm"):
        methods.register_update_rule(clash)
    with pytest.raises(ValueError, match="kind='optimizer', expected one of plain, head"):
        methods.register_update_rule(HALF_SAM._replace(kind="optimizer"))
    with pytest.raises(ValueError, match="'Bad-Name': expected a lowercase Python identifier"):
        methods.register_objective(SMOOTHED._replace(method=SMOOTHED.method._replace(
            name="Bad-Name")))


# --- trained through the command line's path ---------------------------------------------


def train(tmp_path, name, **overrides):
    """A 3-step RotatedDigits run through ``cli.preflight`` and ``train_and_evaluate``,
    as ``python -m sagm_jax.main`` runs it; its records."""
    config = digits_config(steps=3, eval_every=3, test_envs=(0,), **overrides)
    workdir = str(tmp_path / name)
    cli.preflight(config, workdir, ["main"], jax.device_count())
    train_and_evaluate(config, workdir)
    with open(f"{workdir}/results.jsonl") as f:
        return [json.loads(line) for line in f]


def losses_and_accuracies(records):
    return [(r["loss"], r["env1_out_acc"], r["env0_in_acc"]) for r in records]


@pytest.mark.slow
def test_new_methods_train_as_the_built_in_ones_they_equal(registered, tmp_path, capsys):
    half = train(tmp_path, "half_sam", algorithm="half_sam", rho=0.1)
    sam = train(tmp_path, "sam", algorithm="sam", rho=0.05)
    assert losses_and_accuracies(half) == losses_and_accuracies(sam)

    smoothed = train(tmp_path, "smoothed", algorithm="erm", objective="smoothed", smoothing=0.0)
    erm = train(tmp_path, "erm", algorithm="erm")
    assert losses_and_accuracies(smoothed) == losses_and_accuracies(erm)

    mean = train(tmp_path, "domain_mean", algorithm="domain_mean")
    for ours, theirs in zip(losses_and_accuracies(mean), losses_and_accuracies(erm)):
        assert ours == pytest.approx(theirs, rel=1e-5)  # another order of summation

    capsys.readouterr()
    assert collect.main(["--input_dir", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    for label in ("SAM/2", "ERM + Smoothing", "Domain mean", "SAM", "ERM"):
        assert f"| {label} " in report, label
