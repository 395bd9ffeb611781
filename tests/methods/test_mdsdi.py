"""mDSDI (sagm_jax.methods.mdsdi) against a float64 re-statement of the authors' update
(``hamanhbui/mDSDI``, ``algorithms/mDSDI/src/Trainer_mDSDI.py``, ``Trainer_mDSDI.train``),
written here in JAX x64: the two encoders as plain functions, the gradient reversal as
the discriminator loss's gradient subtracted from the encoder's, the covariance tensor
C [N, F, F] built in full, the meta step over a random pairing of the domains (the
reference's ``random_pairs_of_minibatches``) with a fresh torch Adam for each inner step
and torch's Adam (coupled L2) for both persistent optimizers. The network is a tiny dense
featurizer and classifier; whole train steps run through ``make_train_step``. One tiny
end-to-end run checks that the recorded accuracies are the method's prediction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import methods
from sagm_jax.methods import networks
from sagm_jax.methods.procedures import make_procedure
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

from float64_reference import ConvTanhNet, TanhNet, adam_init, f64, torch_adam
from run_fixtures import train_steps

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 2, 2, 3, 4
M, B = 3, 2  # domains, rows per domain
LR, WD = 0.01, 0.1
TOL = {"rtol": 2e-4, "atol": 2e-6}


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def build(net=None):
    rule = methods.update_rule("mdsdi")
    net = net or TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    hp = {"mdsdi_meta_test_weight": 1.0}
    own = networks.init_method_variables(rule.network, jax.random.key(1), shapes, hp,
                                         base=(net, variables))
    variables = networks.with_method_variables(dict(variables), own)
    return networks.MethodModel(net, rule.network, hp), variables


def run_steps(steps=3):
    model, variables = build()
    states, metrics = train_steps(model, variables, "erm", {}, steps,
                                  lambda t: batch(M * B, seed=t), num_domains=M, lr=LR,
                                  wd=WD, key=7, algorithm="mdsdi")
    return model, variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement




def encode(p, x):
    return jnp.tanh(x.reshape(x.shape[0], -1) @ p["kernel"] + p["bias"])


def lin(p, x):
    return x @ p["kernel"] + p["bias"]


def ce(logits, y):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(logp[jnp.arange(len(y)), y])


def class_logits(p, x):  # Classifier(di_z, ds_z) = Linear(cat(zi, zs))
    return lin(p["cls"], jnp.concatenate([encode(p["zi"], x), encode(p["zs"], x)], axis=1))


def ref_losses(p, x, y, d):
    zi, zs = encode(p["zi"], x), encode(p["zs"], x)
    zi_n, zs_n = zi - zi.mean(0)[None, :], zs - zs.mean(0)[None, :]
    c = zi_n[:, :, None] * zs_n[:, None, :]
    disc = p["disc"]
    h = jax.nn.relu(lin(disc["hidden_0"], zi))
    h = jax.nn.relu(lin(disc["hidden_1"], h))
    return {"classification_loss": ce(lin(p["cls"], jnp.concatenate([zi, zs], 1)), y),
            "domain_discriminator_loss": ce(lin(disc["output"], h), d),
            "zs_domain_loss": ce(lin(p["zsc"], zs), d),
            "disentangle_loss": jnp.mean((c - 0.0) ** 2)}






def ref_main_gradients(p, x, y, d):
    total_grad = jax.grad(lambda q: sum(ref_losses(q, x, y, d).values()))(p)
    dc_grad = jax.grad(lambda q: ref_losses(q, x, y, d)["domain_discriminator_loss"])(p)
    return ref_losses(p, x, y, d), total_grad, dc_grad


def inner_ce(theta, p, xx, yy):
    return ce(class_logits({**p, **theta}, xx), yy)


inner_value_and_grad = jax.jit(jax.value_and_grad(inner_ce))


def ref_step(p, s_main, s_meta, x, y, perm):
    d = jnp.repeat(jnp.arange(M), B)
    losses, total_grad, dc_grad = jax.jit(ref_main_gradients)(p, x, y, d)
    # GradReverse: the encoder zi receives -dL_dc/dzi instead of +dL_dc/dzi.
    total_grad["zi"] = jax.tree.map(lambda g, g_dc: g - 2 * g_dc, total_grad["zi"], dc_grad["zi"])
    p, s_main = torch_adam(p, total_grad, s_main, LR, WD)

    theta = {"zs": p["zs"], "cls": p["cls"]}
    meta_grad = jax.tree.map(jnp.zeros_like, theta)
    xs, ys = x.reshape(M, B, *x.shape[1:]), y.reshape(M, B)
    tr_losses, te_losses = [], []
    for j in range(M):  # random_pairs_of_minibatches: meta-test perm[j], the rest meta-train
        rest = [perm[i] for i in range(M) if i != j]
        x_tr, y_tr = jnp.concatenate([xs[i] for i in rest]), jnp.concatenate([ys[i] for i in rest])
        x_te, y_te = xs[perm[j]], ys[perm[j]]
        l_tr, g_tr = inner_value_and_grad(theta, p, x_tr, y_tr)
        inner, _ = torch_adam(theta, g_tr, adam_init(theta), LR, WD)  # a fresh inner Adam
        l_te, g_te = inner_value_and_grad(inner, p, x_te, y_te)
        meta_grad = jax.tree.map(lambda a, b, c: a + b / M + 1.0 * c / M, meta_grad, g_tr, g_te)
        tr_losses.append(l_tr)
        te_losses.append(l_te)
    theta, s_meta = torch_adam(theta, meta_grad, s_meta, LR, WD)
    p = {**p, **theta}
    losses = {k: float(v) for k, v in losses.items()}
    losses.update(loss=sum(losses.values()), meta_train_loss=float(np.mean(tr_losses)),
                  meta_test_loss=float(np.mean(te_losses)))
    return p, s_main, s_meta, losses


def ref_params(params):
    own = params["method"]
    return f64({"zi": params["body"], "zs": own["zs_encoder"]["body"], "cls": own["classifier"],
                "disc": own["discriminator"], "zsc": own["zs_domain_classifier"]})


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def trained():
    return run_steps(3)


def test_three_steps_match_the_authors_update(trained):
    _, variables, states, metrics = trained
    jax.config.update("jax_enable_x64", True)
    try:
        p = ref_params(variables["params"])
        # The copy is the run's network at step 0.
        np.testing.assert_array_equal(p["zs"]["kernel"], p["zi"]["kernel"])
        s_main, s_meta = adam_init(p), adam_init({"zs": p["zs"], "cls": p["cls"]})
        rng = np.random.default_rng(3)
        for t in range(3):
            b = batch(M * B, seed=t)
            p, s_main, s_meta, losses = ref_step(
                p, s_main, s_meta, jnp.asarray(b["image"], jnp.float64),
                jnp.asarray(b["label"]), rng.permutation(M))
            got = states[t + 1].params
            jax.tree.map(lambda a, r: np.testing.assert_allclose(np.asarray(a), r, **TOL),
                         ref_params(got), p)
            for name, value in losses.items():
                np.testing.assert_allclose(float(metrics[t][name]), value, **TOL, err_msg=name)
        # The run's own classifier and the copy's are never used: they stay at init.
        for path in (("classifier",), ("method", "zs_encoder", "classifier")):
            start, end = variables["params"], states[-1].params
            for key in path:
                start, end = start[key], end[key]
            jax.tree.map(np.testing.assert_array_equal, end, start)
        counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(states[-1].opt_state)
                  if "count" in jax.tree_util.keystr(path)]
        assert counts and all(int(c) == 3 for c in counts)  # each optimizer stepped 3 times
    finally:
        jax.config.update("jax_enable_x64", False)


def test_prediction_is_the_classifier_on_both_encoders(trained):
    model, _, states, _ = trained
    variables = {"params": states[-1].params}
    x = batch(5, seed=11)["image"]
    logits = model.apply(variables, jnp.asarray(x), train=False)
    jax.config.update("jax_enable_x64", True)
    try:
        p = ref_params(states[-1].params)
        expected = class_logits(p, jnp.asarray(x, jnp.float64))
    finally:
        jax.config.update("jax_enable_x64", False)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), **TOL)
    feats, _ = model.apply(variables, jnp.asarray(x), train=False, features=True)
    assert feats.shape == (5, 2 * DIM)


@pytest.mark.slow
def test_recorded_accuracies_are_the_methods_prediction(tmp_path):
    """A 3-step RotatedDigits run on two training domains (a small meta step):
    ``load_run`` gives the method's model, whose evaluation over the evaluator's
    batches reproduces the record."""
    from run_fixtures import assert_the_evaluation_reproduces_the_record, digits_config
    from sagm_jax.training import train

    config = digits_config(steps=3, algorithm="mdsdi", test_envs=(0, 1, 2, 3))
    train.train_and_evaluate(config, str(tmp_path))
    model, variables = assert_the_evaluation_reproduces_the_record(tmp_path, "best")
    assert isinstance(model, networks.MethodModel)
    assert "zs_encoder" in variables["params"]["method"]


def test_network_passes_stay_outside_control_flow():
    """XLA's CPU backend runs the convolutions inside a loop body in a slow generic form
    (a RotatedDigits mDSDI step under ``lax.scan`` took 7 s instead of 0.25 s,
    docs/performance.md): the meta step's passes are unrolled over the domains."""
    from test_adversarial import ops_under_control_flow

    model, variables = build(ConvTanhNet(DIM, CLASSES, (HEIGHT, WIDTH)))
    procedure = make_procedure("mdsdi", {}, learning_rate=LR, weight_decay=WD, num_domains=M)
    step = make_train_step(model, procedure, algorithm="mdsdi", method=StepMethod("erm", {}, M))
    state = create_train_state(variables, procedure, {})
    jaxpr = jax.make_jaxpr(step)(state, batch(M * B), jax.random.key(7))
    assert "conv_general_dilated" not in ops_under_control_flow(jaxpr.jaxpr)
    # The main pass and the 2D meta passes each run both encoders forward.
    convolutions = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert len(convolutions) >= 2 * (1 + 2 * M)
