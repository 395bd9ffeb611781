"""ADRMX (sagm_jax.methods.adrmx) against a float64 re-statement of DomainBed's update
(``facebookresearch/DomainBed``, ``domainbed/algorithms.py``, ``ADRMX.update``, with
``SupConLossLambda`` of ``domainbed/lib/misc.py`` as its per-anchor loop with boolean
masks, ``networks.MLP`` and the nonlinear ``networks.Classifier``), written here in JAX
x64: the two featurizers as plain functions, torch's Adam with betas (beta1, 0.9) and no
decay for the discriminator and for the generator, DomainBed's ``update_count`` test for
the alternation, the remix loop over the classes. The remix pairs are the documented
draw (the first two entries of a uniform permutation of each class's count), re-drawn
here from the step's key. Whole train steps run through ``make_train_step`` on a tiny
network; one tiny RotatedDigits run checks that the record is the method's prediction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import methods
from sagm_jax.methods import networks
from sagm_jax.methods.adrmx import remix_pairs, supcon_loss
from sagm_jax.methods.procedures import make_procedure
from sagm_jax.training.train_step import (
    StepMethod,
    create_train_state,
    make_train_step,
    step_keys,
)

from float64_reference import ConvTanhNet, TanhNet, adam_init, f64, ref_ce, torch_adam
from run_fixtures import train_steps

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 2, 2, 8, 4
M, B = 3, 4  # domains, rows per domain
LR, WD, KEY = 0.01, 0.1, 7  # WD: the run's decay, which ADRMX's optimizers ignore
TOL = {"rtol": 2e-4, "atol": 2e-6}
# Per step: singletons (no positive for the contrastive loss, no remix pair) and an
# absent class (skipped, still counted in the remix loss's 1/C).
LABELS = [
    [0, 0, 1, 2, 0, 1, 1, 3, 0, 0, 1, 1],
    [1, 0, 2, 2, 0, 1, 2, 0, 1, 3, 0, 2],
    [2, 2, 1, 0, 0, 1, 1, 0, 2, 1, 0, 0],
    [0, 1, 2, 0, 3, 3, 1, 2, 0, 1, 1, 2],
    [1, 1, 0, 2, 2, 0, 1, 3, 0, 2, 2, 1],
]
LOSS_KEYS = ("loss_total", "loss_cnt_int", "loss_cnt_final", "loss_clf_int",
             "loss_clf_fin", "loss_dmn", "loss_remixed")


def batch(t):
    rng = np.random.default_rng(t)
    return {"image": rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": np.asarray(LABELS[t], np.int32)}


def hparams(**overrides):
    hp = {"adrmx_mlp_depth": 3, "mlp_width": 16}
    hp.update(overrides)
    return hp


def build(hp, net=None):
    rule = methods.update_rule("adrmx")
    net = net or TanhNet(DIM, CLASSES)
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    full = {h.key: hp.get(h.key, h.default) for h in rule.method.hyperparameters}
    own = networks.init_method_variables(rule.network, jax.random.key(1), shapes, full,
                                         base=(net, variables))
    variables = networks.with_method_variables(dict(variables), own)
    return networks.MethodModel(net, rule.network, full), variables


def distinct_copy(variables):
    """``variables`` with the domain featurizer moved off the run's network, as DomainBed's
    two independently initialised MNIST featurizers are: from an exact copy, z = z_l - z_d
    is 0 and, after one Adam step (each weight +-lr), exactly 0 in every feature whose
    gradient signs agree, where float32's rounding noise then decides the next Adam step's
    sign (an ill-conditioned comparison, not a difference of method)."""
    own = dict(variables["params"]["method"])
    body = own["featurizer_domain"]["body"]
    noise = np.random.default_rng(9).normal(scale=0.3, size=body["kernel"].shape)
    moved = {**body, "kernel": body["kernel"] + noise.astype(np.float32)}
    own["featurizer_domain"] = {**own["featurizer_domain"], "body": moved}
    return {**variables, "params": {**variables["params"], "method": own}}


def run_steps(hp, steps, net=None):
    model, variables = build(hp, net)
    variables = distinct_copy(variables)
    states, metrics = train_steps(model, variables, "erm", {}, steps, batch, num_domains=M,
                                  lr=LR, wd=WD, key=KEY, algorithm="adrmx", rule_hp=hp)
    return model, variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement


def encode(p, x):
    return jnp.tanh(x.reshape(x.shape[0], -1) @ p["kernel"] + p["bias"])


def lin(p, x):
    return x @ p["kernel"] + p["bias"]


def ref_classifier(p, x):  # Linear(F, F//2)-ReLU-Linear(F//2, F//4)-ReLU-Linear(F//4, out)
    return lin(p["layer_2"], jax.nn.relu(lin(p["layer_1"], jax.nn.relu(lin(p["layer_0"], x)))))


def ref_mlp(p, x):  # networks.MLP, dropout 0: input, hidden_k, output with relu between
    h = jax.nn.relu(lin(p["input"], x))
    for k in range(len(p) - 2):
        h = jax.nn.relu(lin(p[f"hidden_{k}"], h))
    return lin(p["output"], h)


def ref_supcon(features, labels, domains, lamda=0.5, temperature=0.07):
    """SupConLossLambda.forward: the loop over anchors i, its four sets (positives and
    negatives, in and out of i's domain) as masks over the column ``dots[:, i]``."""
    norm = jnp.sqrt(jnp.maximum(jnp.sum(features**2, axis=1, keepdims=True), 1e-24))
    normalized = features / norm
    dots = normalized @ normalized.T / temperature
    loss, nans = 0.0, 0
    for i in range(len(labels)):
        pos_in = (labels == labels[i]) & (domains == domains[i])
        pos_in[i] = False
        pos_out = (labels == labels[i]) & (domains != domains[i])
        neg_in = (labels != labels[i]) & (domains == domains[i])
        neg_out = (labels != labels[i]) & (domains != domains[i])
        column = dots[:, jnp.asarray(i)]  # a traced index: one eager op for every i
        scaled = np.where(pos_in | neg_in, lamda, 1 - lamda) * jnp.exp(column)
        numerator = jnp.where(pos_in | pos_out, scaled, 0.0)
        denominator = jnp.sum(jnp.where(pos_in | pos_out | neg_in | neg_out, scaled, 0.0)) + 1e-5
        positives = int(pos_in.sum() + pos_out.sum())
        if positives == 0:  # the reference's loss_i is NaN: skipped and counted
            nans += 1
            continue
        log_fraction = jnp.log(numerator / denominator + 1e-5)
        loss = loss - jnp.sum(jnp.where(pos_in | pos_out, log_fraction, 0.0)) / positives
    return loss / (len(labels) - nans + 1)


def step_remix_key(t):
    """The remix draws' key of step t: fold_in(the step's objective key, 3)."""
    return jax.random.fold_in(step_keys(jax.random.key(KEY), t)[2], 3)


def remix_rows(remix_key, labels, within_class):
    """Each class's (row a, row b), or None: the first two entries of a uniform
    permutation of range(n_c), drawn from fold_in(remix_key, c) (a from the first half
    of its split, the rest from the second); DomainBed uses them as rows of the whole
    batch, the fix as positions among class c's rows."""
    rows = []
    for c in range(CLASSES):
        members = np.nonzero(labels == c)[0]
        if len(members) < 2:
            rows.append(None)
            continue
        first_key, second_key = jax.random.split(jax.random.fold_in(remix_key, c))
        a = int(jax.random.randint(first_key, (), 0, len(members)))
        b = int(jax.random.randint(second_key, (), 0, len(members) - 1))
        b = b + 1 if b >= a else b
        rows.append((members[a], members[b]) if within_class else (a, b))
    return rows


def ref_losses(p, x, y, d, rows, hp):
    z_l, z_d = encode(p["fl"], x), encode(p["fd"], x)
    z = z_l - z_d
    disc_loss = jnp.mean(ref_ce(ref_mlp(p["disc"], z), d))
    remixed = 0.0
    for pair in rows:
        if pair is not None:
            a, b = jnp.asarray(pair[0]), jnp.asarray(pair[1])
            logits = ref_classifier(p["h1"], (z[a] + z_d[b]).reshape(1, -1))
            remixed = remixed + ref_ce(logits, jnp.asarray(y)[a].reshape(1))[0]
    terms = {
        "loss_dmn": jnp.mean(ref_ce(ref_classifier(p["hd"], z_d), d)),
        "loss_clf_int": jnp.mean(ref_ce(ref_classifier(p["h1"], z_l), y)),
        "loss_cnt_int": ref_supcon(z_l, y, d),
        "loss_clf_fin": jnp.mean(ref_ce(ref_classifier(p["h2"], z), y)),
        "loss_cnt_final": ref_supcon(z, y, d),
        "loss_remixed": remixed / (CLASSES * 1),
    }
    terms["loss_total"] = (terms["loss_clf_int"] + terms["loss_clf_fin"]
                           + hp["dclf_lambda"] * terms["loss_dmn"]
                           + hp["rmxd_lambda"] * terms["loss_remixed"]
                           + hp["cnt_lambda"] * (terms["loss_cnt_int"] + terms["loss_cnt_final"])
                           + hp["disc_lambda"] * -disc_loss)
    return disc_loss, terms


def ref_step(p, states, t, rows, hp):
    """ADRMX.update at update_count = t + 1; returns the parameters, Adam states and
    reported losses (NaN for those not computed)."""
    b = batch(t)
    x, y = jnp.asarray(b["image"], jnp.float64), np.asarray(b["label"])
    d = np.repeat(np.arange(M), B)
    betas = (hp["beta1"], 0.9)
    k = hp["adrmx_d_steps_per_g_step"]
    reported = dict.fromkeys(LOSS_KEYS, float("nan"))
    if (t + 1) % (1 + k) < k:  # the discriminator's turn
        def disc_loss_of(disc):
            return ref_losses({**p, "disc": disc}, x, y, d, rows, hp)[0]

        loss, grad = jax.jit(jax.value_and_grad(disc_loss_of))(p["disc"])
        disc, states["disc"] = torch_adam(p["disc"], grad, states["disc"], LR, 0.0, betas)
        p = {**p, "disc": disc}
        reported.update(loss_disc=float(loss), loss=float(loss))
        return p, states, reported
    gen = {key: p[key] for key in ("fl", "fd", "h1", "h2", "hd")}

    def total_of(gen):
        disc_loss, terms = ref_losses({**p, **gen}, x, y, d, rows, hp)
        return terms["loss_total"], (disc_loss, terms)

    (_, (disc_loss, terms)), grad = jax.jit(jax.value_and_grad(total_of, has_aux=True))(gen)
    gen, states["gen"] = torch_adam(gen, grad, states["gen"], LR, 0.0, betas)
    reported.update({key: float(v) for key, v in terms.items()},
                    loss_disc=float(disc_loss), loss=float(terms["loss_total"]))
    return {**p, **gen}, states, reported


def ref_params(params):
    own = params["method"]
    return f64({"fl": params["body"], "fd": own["featurizer_domain"]["body"],
                "disc": own["discriminator"], "h1": own["classifier_label_1"],
                "h2": own["classifier_label_2"], "hd": own["classifier_domain"]})


def optimizer_counts(opt_state):
    counts = {"discriminator": set(), "generator": set()}
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        text = jax.tree_util.keystr(path)
        for group, found in counts.items():
            if "count" in text and group in text:
                found.add(int(leaf))
    return counts


# ---------------------------------------------------------------- tests

STEPS = 5  # DomainBed's alternation with k = 2: disc, generator, disc, disc, generator


@pytest.fixture(scope="module")
def trained():
    return run_steps(hparams(), STEPS)


def test_steps_match_domainbeds_update(trained):
    _, variables, states, metrics = trained
    full = {h.key: hparams().get(h.key, h.default)
            for h in methods.update_rule("adrmx").method.hyperparameters}
    rows = [remix_rows(step_remix_key(t), np.asarray(LABELS[t]), False) for t in range(STEPS)]
    jax.config.update("jax_enable_x64", True)
    try:
        p = ref_params(variables["params"])
        adam = {"disc": adam_init(p["disc"]),
                "gen": adam_init({key: p[key] for key in ("fl", "fd", "h1", "h2", "hd")})}
        for t in range(STEPS):
            p, adam, reported = ref_step(p, adam, t, rows[t], full)
            jax.tree.map(lambda a, r: np.testing.assert_allclose(np.asarray(a), r, **TOL),
                         ref_params(states[t + 1].params), p)
            for name, value in reported.items():
                np.testing.assert_allclose(float(metrics[t][name]), value, **TOL,
                                           err_msg=f"step {t}: {name}")
    finally:
        jax.config.update("jax_enable_x64", False)
    # Both networks' own linear classifiers are never used: they stay at init.
    start, end = variables["params"], states[-1].params
    for path in (("classifier",), ("method", "featurizer_domain", "classifier")):
        a, b = start, end
        for key in path:
            a, b = a[key], b[key]
        jax.tree.map(np.testing.assert_array_equal, b, a)
    assert optimizer_counts(states[-1].opt_state) == {"discriminator": {3}, "generator": {2}}


@pytest.mark.parametrize("within_class", [False, True])
def test_remix_pairs_are_the_documented_draw(within_class):
    """DomainBed's rows perm[:2] of the whole batch (default) and the fix's rows of the
    class, against the draw re-stated; both orders of a class of two rows drawn."""
    labels = np.array([0, 2, 2, 1, 0, 2, 3, 0, 2, 1, 0, 0])
    seen = set()
    draw = jax.jit(remix_pairs, static_argnums=(2, 3))
    for seed in range(12):
        key = jax.random.key(seed)
        first, second, valid = draw(key, jnp.asarray(labels), 5, within_class)
        expected = remix_rows(key, labels, within_class) + [None]  # class 4: absent
        for c, pair in enumerate(expected):
            assert bool(valid[c]) == (pair is not None), (seed, c)
            if pair is not None:
                assert (int(first[c]), int(second[c])) == tuple(pair), (seed, c)
        seen.add((int(first[1]), int(second[1])))  # class 1: rows 3 and 9, 2 members
    assert seen == ({(3, 9), (9, 3)} if within_class else {(0, 1), (1, 0)})


def test_domain_featurizer_starts_as_the_runs_network():
    _, variables = build(hparams())
    own = variables["params"]["method"]["featurizer_domain"]
    jax.tree.map(np.testing.assert_array_equal, own, {k: v for k, v in variables["params"].items()
                                                      if k != "method"})


def test_contrastive_loss_of_zero_features_has_a_zero_gradient():
    """DomainBed's ResNet featurizers start equal, so z = z_l - z_d is 0 at the first
    generator step: F.normalize's clamped norm carries no gradient there and the loss's
    gradient is 0 (a plain norm's derivative at 0 would be NaN and poison the step)."""
    labels, domains = jnp.array([0, 0, 1, 1, 0, 1]), jnp.array([0, 1, 0, 1, 2, 2])
    value, grad = jax.jit(jax.value_and_grad(supcon_loss))(jnp.zeros((6, 4)), labels, domains)
    # All similarities 0: each anchor has 2 positives among 5 others of weight 0.5.
    np.testing.assert_allclose(float(value), -6 * np.log(0.5 / (2.5 + 1e-5) + 1e-5) / 7,
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_contrastive_loss_weighs_in_and_out_of_domain_positives():
    """SupConLossLambda with lamda 0.3 (ADRMX's is 0.5, where both weights agree)."""
    rng = np.random.default_rng(5)
    features = rng.normal(size=(10, 5)).astype(np.float32)
    labels = np.array([0, 0, 1, 1, 0, 2, 1, 0, 3, 1])
    domains = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    ours = float(jax.jit(supcon_loss, static_argnums=3)(
        jnp.asarray(features), jnp.asarray(labels), jnp.asarray(domains), 0.3))
    jax.config.update("jax_enable_x64", True)
    try:
        expected = float(jax.jit(lambda f: ref_supcon(f, labels, domains, 0.3))(
            jnp.asarray(features, jnp.float64)))
    finally:
        jax.config.update("jax_enable_x64", False)
    np.testing.assert_allclose(ours, expected, rtol=1e-5)


def test_prediction_is_the_label_featurizer_and_first_head(trained):
    model, _, states, _ = trained
    variables = {"params": states[-1].params}
    x = batch(0)["image"][:5]
    logits = model.apply(variables, jnp.asarray(x), train=False)
    jax.config.update("jax_enable_x64", True)
    try:
        p = ref_params(states[-1].params)
        expected = ref_classifier(p["h1"], encode(p["fl"], jnp.asarray(x, jnp.float64)))
    finally:
        jax.config.update("jax_enable_x64", False)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), **TOL)


def test_network_passes_stay_outside_control_flow():
    """Both featurizers' passes run once per step, outside the cond that picks the
    optimizer (XLA's CPU backend runs convolutions inside a branch slowly)."""
    from test_adversarial import ops_under_control_flow

    model, variables = build(hparams(), ConvTanhNet(DIM, CLASSES, (HEIGHT, WIDTH)))
    procedure = make_procedure("adrmx", hparams(), learning_rate=LR, weight_decay=WD,
                               num_domains=M)
    step = make_train_step(model, procedure, algorithm="adrmx", method=StepMethod("erm", {}, M))
    jaxpr = jax.make_jaxpr(step)(create_train_state(variables, procedure, {}), batch(0),
                                 jax.random.key(KEY))
    assert "conv_general_dilated" not in ops_under_control_flow(jaxpr.jaxpr)
    convolutions = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert len(convolutions) >= 2  # f_l's and f_d's forward passes


def test_random_search_draws_domainbeds_adrmx_hparams():
    """DomainBed's ADRMX block and its own lr (SMALL_IMAGES or not), each name drawn from
    RandomState(seed_hash(seed_hash(hparams_seed, trial_seed), name)) as written there."""
    import hashlib

    from sagm_jax.sweep.hparams import random_hparams

    def db_seed_hash(*args):
        return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)

    def domainbed(dataset_small, seed, trial):
        setting = db_seed_hash(seed, trial)

        def draw(name, fn):
            return fn(np.random.RandomState(db_seed_hash(setting, name)))

        lrs = [5e-4, 1e-3, 2e-3, 3e-3] if dataset_small else [2e-5, 3e-5, 4e-5, 5e-5]
        return {"cnt_lambda": draw("cnt_lambda", lambda r: r.choice([1.0])),
                "dclf_lambda": draw("dclf_lambda", lambda r: r.choice([1.0])),
                "disc_lambda": draw("disc_lambda", lambda r: r.choice([0.75])),
                "rmxd_lambda": draw("rmxd_lambda", lambda r: r.choice([1.0])),
                "adrmx_d_steps_per_g_step": draw("d_steps_per_g_step", lambda r: r.choice([2])),
                "beta1": draw("beta1", lambda r: r.choice([0.5])),
                "mlp_width": draw("mlp_width", lambda r: r.choice([256])),
                "adrmx_mlp_depth": draw("mlp_depth", lambda r: int(r.choice([8, 9, 10]))),
                "mlp_dropout": draw("mlp_dropout", lambda r: r.choice([0])),
                "lr": draw("lr", lambda r: r.choice(lrs))}

    depths = set()
    for dataset, small in (("PACS", False), ("RotatedDigits", True)):
        for seed, trial in ((1, 0), (2, 0), (3, 1), (4, 2), (5, 0), (6, 1)):
            ours = random_hparams("adrmx", dataset, seed, trial)
            for key, value in domainbed(small, seed, trial).items():
                assert ours[key] == value, (dataset, seed, trial, key)
            depths.add(ours["adrmx_mlp_depth"])
    assert depths == {8, 9, 10}
    defaults = random_hparams("adrmx", "PACS", 0, 0)
    assert (defaults["lr"], defaults["adrmx_d_steps_per_g_step"],
            defaults["adrmx_mlp_depth"]) == (3e-5, 2, 9)
    assert random_hparams("adrmx", "RotatedDigits", 0, 0)["lr"] == 3e-3


@pytest.mark.slow
def test_digits_run_records_the_methods_prediction(tmp_path):
    """A 3-step RotatedDigits run (discriminator, generator, discriminator) with a
    shallow discriminator: every reported loss reaches the record, and ``load_run``'s
    model reproduces the recorded accuracies (the method's prediction)."""
    import json

    from run_fixtures import assert_the_evaluation_reproduces_the_record, digits_config
    from sagm_jax.training import train

    config = digits_config(steps=3, eval_every=3, algorithm="adrmx", adrmx_mlp_depth=3,
                           mlp_width=32, test_envs=(0, 1, 2, 3))
    train.train_and_evaluate(config, str(tmp_path))
    with open(tmp_path / "results.jsonl") as f:
        records = [json.loads(line) for line in f]
    for key in ("loss_disc", *LOSS_KEYS):
        assert np.isfinite(records[-1][key]), key
    model, variables = assert_the_evaluation_reproduces_the_record(tmp_path, "best")
    assert isinstance(model, networks.MethodModel)
    assert "featurizer_domain" in variables["params"]["method"]
