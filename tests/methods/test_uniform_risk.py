"""URM (sagm_jax.methods.uniform_risk) against a float64 re-statement of DomainBed's
``class URM(ERM)`` (``domainbed/algorithms.py``) and its featurizer's output activation
(``domainbed/networks.py``), written here in JAX x64: the generator loss stepped by a
torch Adam over featurizer and classifier, then the discriminator (Linear-LeakyReLU MLP)
on the same pass's detached features against uniform noise, stepped by a torch Adam or
SGD (momentum 0.9) with the run's weight decay. The random draws are computed here from
the key derivation ``sagm_jax.methods.uniform_risk`` documents. Whole train steps run
through ``make_train_step`` on a tiny linear featurizer (so the activation is the only
nonlinearity before the head); one short end-to-end run trains URM on RotatedDigits;
the sweep's draws are checked against DomainBed's hparams_registry rule."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from float64_reference import adam_init, f64, ref_ce, torch_adam

from sagm_jax import methods
from sagm_jax.methods import networks, procedures
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

HEIGHT, WIDTH, DIM, CLASSES = 2, 3, 5, 4
M, B = 3, 4  # domains, rows per domain
N = M * B
LR, WD = 0.01, 0.1
KEY = 5
TOL = {"rtol": 2e-4, "atol": 2e-6}
HP = {"urm_adv_lambda": 0.7, "urm_discriminator_label_smoothing": 0.0,
      "urm_discriminator_optimizer": "adam", "urm_discriminator_hidden_layers": 1,
      "urm_generator_output": "tanh", "urm_discriminator_lr": 0.02}


class LinearNet(nn.Module):
    """features = flatten(x) @ body + b (the featurizer's raw output), logits = classifier."""

    @nn.compact
    def __call__(self, x, train: bool, mixstyle: bool = False, features: bool = False):
        h = nn.Dense(DIM, name="body")(x.reshape(x.shape[0], -1))
        logits = nn.Dense(CLASSES, name="classifier")(h)
        return (h, logits) if features else logits


def batch(t):
    rng = np.random.default_rng(100 + t)
    return {"image": rng.normal(size=(N, HEIGHT, WIDTH, 1)).astype(np.float32),
            "label": rng.integers(0, CLASSES, N).astype(np.int32)}


def build(hp):
    net = LinearNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, 1)), train=False)
    rule = methods.update_rule("urm")
    shapes = networks.Shapes((HEIGHT, WIDTH, 1), DIM, CLASSES, M)
    own = rule.network.init(jax.random.key(1), shapes, hp)
    variables = networks.with_method_variables(dict(variables), own)
    return networks.wrap(net, rule.network, hp), variables


def run_steps(hp, steps):
    model, variables = build(hp)
    proc = procedures.make_procedure("urm", hp, learning_rate=LR, weight_decay=WD,
                                     num_domains=M)
    step = jax.jit(make_train_step(model, proc, algorithm="urm",
                                   method=StepMethod("erm", {}, M)))
    states, metrics = [create_train_state(variables, proc, {})], []
    for t in range(steps):
        state, values = step(states[-1], batch(t), jax.random.key(KEY))
        states.append(state)
        metrics.append(values)
    return model, variables, states, metrics


def draws(t):
    """Step t's (noise U[0,1) [N, DIM], labels' U[0,1) for noise and features [N]), from
    the documented derivation: the train step's objective key (the third of
    split(fold_in(key, t), 3)), then fold_in 1 (noise), 2 and 3 (the labels)."""
    key = jax.random.split(jax.random.fold_in(jax.random.key(KEY), t), 3)[2]
    u = [jax.random.uniform(jax.random.fold_in(key, 1), (N, DIM), jnp.float32),
         jax.random.uniform(jax.random.fold_in(key, 2), (N,), jnp.float32),
         jax.random.uniform(jax.random.fold_in(key, 3), (N,), jnp.float32)]
    return [np.asarray(a, np.float64) for a in u]


# ---------------------------------------------------------------- float64 re-statement

ACT = {"tanh": jnp.tanh, "relu": lambda v: jnp.maximum(v, 0.0),
       "sigmoid": lambda v: 1.0 / (1.0 + jnp.exp(-v))}
RANGE = {"tanh": (-1.0, 1.0), "relu": (0.0, 1.0), "sigmoid": (0.0, 1.0)}


def ref_featurize(net, x, activation):
    """DomainBed's featurizer with ``self.activation`` set: act(flat(x) W + b)."""
    return ACT[activation](x.reshape(len(x), -1) @ net["body"]["kernel"] + net["body"]["bias"])


def ref_classify(net, z):
    return z @ net["classifier"]["kernel"] + net["classifier"]["bias"]


def ref_discriminator(disc, u):
    """nn.Sequential(dense1, LeakyReLU, [dense_k, LeakyReLU]..., output)."""
    h = u
    for k in range(1, len(disc)):
        h = h @ disc[f"dense{k}"]["kernel"] + disc[f"dense{k}"]["bias"]
        h = jnp.where(h >= 0, h, 0.01 * h)
    return (h @ disc["output"]["kernel"] + disc["output"]["bias"]).reshape(-1)


def ref_bce(logits, targets):
    """BCEWithLogitsLoss (mean): -[t log sigmoid(l) + (1 - t) log(1 - sigmoid(l))]."""
    log_p, log_q = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
    return -jnp.mean(targets * log_p + (1 - targets) * log_q)


def ref_sgd(params, grads, state, lr, wd):
    """torch.optim.SGD(lr, momentum=0.9, weight_decay=wd): buf = g at the first step."""
    g = jax.tree.map(lambda gr, w: gr + wd * w, grads, params)
    buf = g if state is None else jax.tree.map(lambda b, gi: 0.9 * b + gi, state, g)
    return jax.tree.map(lambda w, b: w - lr * b, params, buf), buf


def ref_gradients(net, disc, x, y, u, hp):
    """``URM.update``'s two backward passes, both at the step's start: the generator loss
    (``_compute_loss``) and its gradient over the network, then the discriminator loss
    on the same pass's detached features and its gradient over D (the generator's step
    changes neither: D is not in its optimizer, and ``feats`` is the pass before it).
    ``u`` holds the step's uniform draws (:func:`draws`)."""
    lam, act = hp["urm_adv_lambda"], hp["urm_generator_output"]

    def generator_loss(net):
        feats = ref_featurize(net, x, act)
        ce = ref_ce(ref_classify(net, feats), y).mean()
        return ce + lam * ref_bce(ref_discriminator(disc, feats), jnp.ones(len(x))), feats

    (loss, feats), grads = jax.value_and_grad(generator_loss, has_aux=True)(net)
    feats = jax.lax.stop_gradient(feats)  # feats.detach()
    u_noise, u_true, u_fake = u
    a, b = RANGE[act]
    noise = (b - a) * u_noise + a
    s = hp["urm_discriminator_label_smoothing"]
    if s:  # _generate_soft_labels
        true_y, fake_y = (1.0 - (1 - s)) * u_true + (1 - s), s * u_fake
    else:
        true_y, fake_y = np.ones(len(x)), np.zeros(len(x))

    def d_loss(disc):
        return (ref_bce(ref_discriminator(disc, noise), true_y)
                + lam * ref_bce(ref_discriminator(disc, feats), fake_y))

    return loss, grads, jax.grad(d_loss)(disc)


def ref_update(net, disc, opt_net, opt_disc, x, y, u, hp, gradients=ref_gradients):
    """One ``URM.update``: the network's Adam step, then the discriminator's."""
    loss, grads, d_grads = gradients(net, disc, x, y, u, hp)
    net, opt_net = torch_adam(net, grads, opt_net, LR, WD)
    if hp["urm_discriminator_optimizer"] == "adam":
        disc, opt_disc = torch_adam(disc, d_grads, opt_disc, hp["urm_discriminator_lr"], WD)
    else:
        disc, opt_disc = ref_sgd(disc, d_grads, opt_disc, hp["urm_discriminator_lr"], WD)
    return net, disc, opt_net, opt_disc, loss


def assert_tree_close(got, want, what):
    flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], what
    for (path, a), (_, b) in zip(flat_got, flat_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def adam_counts(state):
    return [int(s.count) for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)]


# ---------------------------------------------------------------- tests


CASES = {
    "adam-tanh-hard-labels": {},
    "sgd-sigmoid-smoothed": {"urm_discriminator_optimizer": "sgd",
                             "urm_generator_output": "sigmoid",
                             "urm_discriminator_label_smoothing": 0.3,
                             "urm_discriminator_hidden_layers": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_steps_match_domainbeds_update(case):
    """Featurizer, classifier and discriminator after each of 3 steps, the reported loss,
    both optimizers' state (Adam counts; SGD's momentum buffer), and the prediction
    classifier(act(features)) at the end."""
    hp = {**HP, **CASES[case]}
    model, variables, states, metrics = run_steps(hp, 3)
    layers = hp["urm_discriminator_hidden_layers"]
    assert set(states[0].params["method"]["discriminator"]) == {
        *(f"dense{k}" for k in range(1, layers + 2)), "output"}
    assert set(metrics[0]) == {"loss"}
    with jax.enable_x64(True):
        network, own = networks.split_params(f64(variables["params"]))
        disc = own["discriminator"]
        opt_net, opt_disc = adam_init(network), (
            adam_init(disc) if hp["urm_discriminator_optimizer"] == "adam" else None)
        # The backward passes jitted (eager float64 is slow); the optimizers eager.
        gradients = jax.jit(functools.partial(ref_gradients, hp=hp))
        for t in range(3):
            data = batch(t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            network, disc, opt_net, opt_disc, loss = ref_update(
                network, disc, opt_net, opt_disc, x, y, draws(t), hp,
                gradients=lambda *a: gradients(*a[:5]))
            got_network, got_own = networks.split_params(states[t + 1].params)
            assert_tree_close(got_network, network, f"step {t} network")
            assert_tree_close(got_own["discriminator"], disc, f"step {t} discriminator")
            np.testing.assert_allclose(float(metrics[t]["loss"]), float(loss), **TOL)
        opt = states[-1].opt_state
        main_counts = adam_counts(opt["main"])
        assert main_counts == [3], main_counts
        if hp["urm_discriminator_optimizer"] == "adam":
            assert adam_counts(opt["discriminator"]) == [3]
        else:
            trace = [s for s in opt["discriminator"] if isinstance(s, optax.TraceState)]
            assert_tree_close(trace[0].trace["discriminator"], opt_disc, "SGD momentum")
        x = jnp.asarray(batch(7)["image"], jnp.float64)
        want_z = ref_featurize(network, x, hp["urm_generator_output"])
        want_logits = ref_classify(network, want_z)
    z, logits = model.apply({"params": states[-1].params}, jnp.asarray(batch(7)["image"]),
                            train=False, features=True)
    np.testing.assert_allclose(np.asarray(z), np.asarray(want_z), **TOL)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), **TOL)


def test_draws_differ_between_steps_and_lie_in_their_ranges():
    """The noise and labels come from the step's key: new ones each step, in [0, 1)."""
    a, b = draws(0), draws(1)
    for u, v in zip(a, b):
        assert not np.allclose(u, v)
        assert 0.0 <= u.min() and u.max() < 1.0
    assert not np.allclose(a[1], a[2])  # the noise's and the features' labels differ


def test_discriminator_is_torch_linear_init():
    """dense1 [d, 100], dense2..dense{k+1} [100, 100], output [100, 1], each kernel and
    bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) from split(fold_in(key, layer))."""
    d = 64
    own = methods.update_rule("urm").network.init(
        jax.random.key(3), networks.Shapes((8, 8, 1), d, 7, 3),
        {**HP, "urm_discriminator_hidden_layers": 2})
    disc = own["params"]["discriminator"]
    assert list(disc) == ["dense1", "dense2", "dense3", "output"]
    for i, (name, fan_in, fan_out) in enumerate(
            [("dense1", d, 100), ("dense2", 100, 100), ("dense3", 100, 100), ("output", 100, 1)]):
        kernel_key, bias_key = jax.random.split(jax.random.fold_in(jax.random.key(3), i))
        bound = 1.0 / np.sqrt(fan_in)
        np.testing.assert_array_equal(disc[name]["kernel"], jax.random.uniform(
            kernel_key, (fan_in, fan_out), jnp.float32, -bound, bound))
        np.testing.assert_array_equal(disc[name]["bias"], jax.random.uniform(
            bias_key, (fan_out,), jnp.float32, -bound, bound))


def test_registry_entry_and_identity_refused():
    rule = methods.update_rule("urm")
    assert rule.kind == "procedure" and rule.method.label == "URM"
    assert rule.method.published == ()
    got = {h.key: (h.default, h.bounds, h.distribution.text) for h in rule.method.hyperparameters}
    assert got == {
        "urm_adv_lambda": (0.1, ">= 0", "U(0,0.2)"),
        "urm_discriminator_label_smoothing": (0.0, "[0, 1]", "U(0,0)"),
        "urm_discriminator_optimizer": ("adam", "one of adam, sgd", "{adam}"),
        "urm_discriminator_hidden_layers": (1, "int >= 0", "{1, 2, 3}"),
        "urm_generator_output": ("tanh", "one of tanh, relu, sigmoid", "{tanh, relu}"),
        "urm_discriminator_lr": (5e-5, "> 0", "10^U(-6,-4.5)"),
    }
    assert methods.combination_problem("coral", "urm", 0.0)
    from sagm_jax.training import rundir  # DomainBed's collect_results reads its class name

    assert rundir.record_algorithm({"algorithm": "urm", "objective": "erm"}) == "URM"
    from sagm_jax.config import checks

    output = next(h for h in rule.method.hyperparameters if h.key == "urm_generator_output")
    check = checks.bounds(output.bounds, output.note)  # the config's check of the field
    assert check("identity", None, None) == (
        "one of tanh, relu, sigmoid (identity: the uniform noise URM matches has no range "
        "for unbounded features; DomainBed's URM raises at its first step)")
    assert check("relu", None, None) is None


# DomainBed's hparams_registry for URM, re-stated: each name drawn from its own
# RandomState(seed_hash(seed_hash(hparams_seed, trial_seed), name)).
def db_seed_hash(*args):
    import hashlib

    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def db_urm(dataset, hparams_seed, trial_seed):
    small = dataset in ("RotatedMNIST", "ColoredMNIST", "RotatedDigits")
    table = {
        "urm_adv_lambda": (0.1, lambda r: float(r.uniform(0, 0.2))),
        "urm_discriminator_label_smoothing": (0, lambda r: float(r.uniform(0, 0))),
        "urm_discriminator_optimizer": ("adam", lambda r: str(r.choice(["adam"]))),
        "urm_discriminator_hidden_layers": (1, lambda r: int(r.choice([1, 2, 3]))),
        "urm_generator_output": ("tanh", lambda r: str(r.choice(["tanh", "relu"]))),
        "urm_discriminator_lr": (1e-3, lambda r: 10 ** r.uniform(-5.5, -3.5)) if small
        else (5e-5, lambda r: 10 ** r.uniform(-6, -4.5)),
    }
    setting = db_seed_hash(hparams_seed, trial_seed)
    return {name: default if hparams_seed == 0
            else draw(np.random.RandomState(db_seed_hash(setting, name)))
            for name, (default, draw) in table.items()}


@pytest.mark.parametrize("dataset", ["PACS", "RotatedMNIST"])
def test_sweep_draws_urms_hyperparameters_as_domainbed(dataset):
    from sagm_jax.sweep.hparams import random_hparams

    outputs = set()
    for hparams_seed, trial_seed in [(0, 0), (1, 0), (2, 1), (5, 2), (9, 0), (13, 1)]:
        got = random_hparams("urm", dataset, hparams_seed, trial_seed)
        want = db_urm(dataset, hparams_seed, trial_seed)
        assert {k: got[k] for k in want} == want, (hparams_seed, trial_seed)
        assert type(got["urm_generator_output"]) is str
        outputs.add(got["urm_generator_output"])
    assert outputs == {"tanh", "relu"}


@pytest.mark.slow
def test_urm_trains_on_rotated_digits_and_its_record_is_its_prediction(tmp_path):
    """3 steps of URM on RotatedDigits: ``load_run`` gives the method's model (the output
    activation before the classifier), whose evaluation reproduces the record."""
    from run_fixtures import assert_the_evaluation_reproduces_the_record, digits_config

    from sagm_jax.training import train

    config = digits_config(steps=3, algorithm="urm", urm_generator_output="relu")
    records = train.train_and_evaluate(config, str(tmp_path))
    assert np.isfinite(records[-1]["loss"])
    model, variables = assert_the_evaluation_reproduces_the_record(tmp_path, "best")
    assert isinstance(model, networks.MethodModel)
    feats, _ = model.apply(variables, jnp.zeros((2, 28, 28, 1)) + 0.5, train=False,
                           features=True)
    assert float(jnp.min(feats)) >= 0.0  # relu's output
    assert set(variables["params"]["method"]["discriminator"]) == {"dense1", "dense2", "output"}
