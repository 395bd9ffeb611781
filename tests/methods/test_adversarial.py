"""DANN and CDANN (sagm_jax.methods.adversarial) against a float64 re-statement of
DomainBed's ``AbstractDANN.update`` (``domainbed/algorithms.py``) and ``networks.MLP``.

The network is a tanh featurizer (z = tanh(flat(x) @ W + c)) and the linear classifier
``params["classifier"]``; the discriminator is the package's MLP parameters. The
re-statement is JAX in float64, written here independently of the package: the
discriminator loss differentiated by ``jax.grad`` (the input gradient inside it, as
``create_graph=True``), CDANN's weights from ``np.bincount`` (``F.one_hot(all_y).sum(0)``),
two NumPy PyTorch Adams (coupled L2, betas (beta1, 0.9)), each stepping on its own turns
of ``update_count % (1 + d) < d`` with ``update_count`` incremented first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import procedure_steps

from sagm_jax import methods
from sagm_jax.methods import adversarial, networks, procedures
from sagm_jax.methods.objectives import Outputs

M, PER_DOMAIN, HEIGHT, WIDTH, DIM, CLASSES = 3, 4, 2, 3, 5, 4
HP = {"dann_lambda": 0.7, "lr_d": 0.03, "lr_g": 0.02, "weight_decay_d": 0.1,
      "weight_decay_g": 0.2, "beta1": 0.5, "d_steps_per_g_step": 1, "grad_penalty": 0.4,
      "mlp_width": 7, "mlp_depth": 3, "mlp_dropout": 0.0}
TOL = {"rtol": 2e-4, "atol": 2e-6}


def make_problem(conditional, seed=0, labels=None):
    rng = np.random.default_rng(seed)
    network = {
        "featurizer": {"kernel": rng.normal(0, 0.6, (HEIGHT * WIDTH, DIM)),
                       "bias": rng.normal(0, 0.2, (DIM,))},
        "classifier": {"kernel": rng.normal(0, 0.8, (DIM, CLASSES)),
                       "bias": rng.normal(0, 0.3, (CLASSES,))},
    }
    shapes = networks.Shapes((HEIGHT, WIDTH, 1), DIM, CLASSES, M)
    own = adversarial.adversary_init(conditional)(jax.random.PRNGKey(seed), shapes, HP)
    params = {**jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), network),
              "method": own["params"]}
    images = rng.normal(0, 1, (M * PER_DOMAIN, HEIGHT, WIDTH, 1)).astype(np.float32)
    if labels is None:
        labels = rng.integers(0, CLASSES, M * PER_DOMAIN)
    return params, images, np.asarray(labels, np.int32)


def forward_at(params, dropout_key):
    """A training pass as the train step's ``forward_at`` gives it."""
    del dropout_key  # the tiny featurizer has no dropout

    def forward(images):
        layer = params["featurizer"]
        features = jnp.tanh(images.reshape(images.shape[0], -1) @ layer["kernel"]
                            + layer["bias"])
        logits = networks.classify(params, features)
        return Outputs(features, logits, {}, lambda f: networks.classify(params, f))

    return forward


def run_package(name, hp, params, images, labels, steps):
    history = procedure_steps(name, hp, params, forward_at, images, labels, steps,
                              num_domains=M, lr=1.0, wd=1.0)
    return [(p, metrics) for p, _, metrics in history], history[-1][1]


# ---------------------------------------------------------------- float64 re-statement


def ref_mlp(layers, x):
    h = jax.nn.relu(x @ layers["input"]["kernel"] + layers["input"]["bias"])
    for k in range(len(layers) - 2):
        h = jax.nn.relu(h @ layers[f"hidden_{k}"]["kernel"] + layers[f"hidden_{k}"]["bias"])
    return h @ layers["output"]["kernel"] + layers["output"]["bias"]


def ref_disc_loss(own, z, y, conditional, hp):
    domains = np.repeat(np.arange(M), PER_DOMAIN)
    u = z + own["class_embeddings"][y] if conditional else z

    def rows(u_):
        logp = jax.nn.log_softmax(ref_mlp(own["discriminator"], u_))
        return -logp[np.arange(len(domains)), domains]

    ce = rows(u)
    input_grad = jax.grad(lambda u_: jnp.sum(rows(u_)))(u)
    if conditional:
        y_counts = np.bincount(y)  # F.one_hot(all_y).sum(dim=0): width max(y) + 1
        loss = jnp.sum(1.0 / (y_counts[y] * len(y_counts)) * ce)
    else:
        loss = jnp.mean(ce)
    return loss + hp["grad_penalty"] * jnp.mean(jnp.sum(input_grad**2, axis=1))


def ref_features(network, x):
    layer = network["featurizer"]
    return jnp.tanh(x.reshape(x.shape[0], -1) @ layer["kernel"] + layer["bias"])


def ref_gen_loss(network, own, x, y, conditional, hp):
    z = ref_features(network, x)
    logits = z @ network["classifier"]["kernel"] + network["classifier"]["bias"]
    classifier_loss = -jnp.mean(jax.nn.log_softmax(logits)[np.arange(len(y)), y])
    return classifier_loss + hp["dann_lambda"] * -ref_disc_loss(own, z, y, conditional, hp)


def np_adam(params, grads, state, lr, wd, beta1):
    """torch.optim.Adam(lr, weight_decay=wd, betas=(beta1, 0.9)), eps 1e-8."""
    t = state["t"] + 1
    flat_p, tree = jax.tree.flatten(params)
    flat_g, flat_m, flat_v = jax.tree.leaves(grads), state["m"], state["v"]
    new_p, new_m, new_v = [], [], []
    for p, g, m, v in zip(flat_p, flat_g, flat_m, flat_v):
        g = np.asarray(g) + wd * p
        m, v = beta1 * m + (1 - beta1) * g, 0.9 * v + 0.1 * g * g
        new_p.append(p - lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - 0.9**t)) + 1e-8))
        new_m.append(m)
        new_v.append(v)
    return jax.tree.unflatten(tree, new_p), {"t": t, "m": new_m, "v": new_v}


def reference(params, images, labels, steps, conditional, hp):
    """DomainBed's update, ``steps`` times: [(network, own, reported losses)]."""
    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree.map(lambda v: np.asarray(v, np.float64), tree)
        network, own = (to64(part) for part in networks.split_params(params))
        x, y = np.asarray(images, np.float64), np.asarray(labels)
        fresh = lambda tree: {"t": 0, "m": [np.zeros_like(v) for v in jax.tree.leaves(tree)],
                              "v": [np.zeros_like(v) for v in jax.tree.leaves(tree)]}
        disc_state, gen_state, history = fresh(own), fresh(network), []
        d = hp["d_steps_per_g_step"]
        for update_count in range(1, steps + 1):  # incremented before the test
            if update_count % (1 + d) < d:
                z = ref_features(network, x)
                loss, grads = jax.value_and_grad(ref_disc_loss)(own, z, y, conditional, hp)
                own, disc_state = np_adam(own, grads, disc_state, hp["lr_d"],
                                          hp["weight_decay_d"], hp["beta1"])
                reported = {"disc_loss": float(loss)}
            else:
                loss, grads = jax.value_and_grad(ref_gen_loss)(network, own, x, y,
                                                               conditional, hp)
                network, gen_state = np_adam(network, grads, gen_state, hp["lr_g"],
                                             hp["weight_decay_g"], hp["beta1"])
                reported = {"gen_loss": float(loss)}
            history.append((to64(network), to64(own), reported))
        return history, disc_state["t"], gen_state["t"]


def assert_tree_close(got, want, what):
    flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], what
    for (path, a), (_, b) in zip(flat_got, flat_want):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"{what} {jax.tree_util.keystr(path)}")


def check_against_reference(name, hp, params, images, labels, steps=3):
    conditional = name == "cdann"
    history, state = run_package(name, hp, params, images, labels, steps)
    expected, disc_count, gen_count = reference(params, images, labels, steps, conditional, hp)
    for t, ((got, metrics), (network, own, reported)) in enumerate(zip(history, expected)):
        got_network, got_own = networks.split_params(got)
        assert_tree_close(got_network, network, f"step {t} network")
        assert_tree_close(got_own, own, f"step {t} method")
        (key, value), = reported.items()
        other = "gen_loss" if key == "disc_loss" else "disc_loss"
        np.testing.assert_allclose(metrics[key], value, **TOL, err_msg=f"step {t} {key}")
        assert metrics["loss"] == metrics[key] and np.isnan(metrics[other]), (t, metrics)
    # Each Adam's count moved on its own steps only.
    assert int(state["discriminator"][1].count) == disc_count
    assert int(state["generator"][1].count) == gen_count
    return history


# ---------------------------------------------------------------- tests


def test_registry_entries():
    assert {"dann", "cdann"} <= set(methods.rule_names("procedure"))
    dann, cdann = methods.update_rule("dann"), methods.update_rule("cdann")
    assert dann.method.published == (83.6, 78.6, 65.9, 46.7, 38.3, 62.6, "DomainBed")
    assert cdann.method.published == (82.6, 77.5, 65.8, 45.8, 38.3, 62.0, "DomainBed")
    keys = [h.key for h in cdann.method.hyperparameters]
    assert keys == [h.key for h in dann.method.hyperparameters] + ["cdann_balance"]
    draws = {h.key: h.distribution.text for h in dann.method.hyperparameters}
    assert draws["d_steps_per_g_step"] == "int(2^U(0,3))"
    assert draws["mlp_width"] == "int(2^U(6,10))" and draws["dann_lambda"] == "10^U(-2,2)"


@pytest.mark.parametrize("d_steps", [1, 2])  # 1: gen, disc, gen; 2: disc, gen, disc
def test_dann_update_is_domainbeds(d_steps):
    hp = {**HP, "d_steps_per_g_step": d_steps}
    params, images, labels = make_problem(conditional=False, seed=d_steps)
    assert set(params["method"]) == {"discriminator"}  # DANN's unused embeddings: none
    history = check_against_reference("dann", hp, params, images, labels)
    kinds = ["disc_loss" if not np.isnan(m["disc_loss"]) else "gen_loss" for _, m in history]
    assert kinds == (["gen_loss", "disc_loss", "gen_loss"] if d_steps == 1
                     else ["disc_loss", "gen_loss", "disc_loss"])


def test_cdann_update_is_domainbeds_with_missing_classes():
    """Labels {0, 2} of 4 classes: F.one_hot sizes 3 classes from the batch's largest
    label, so the weights sum to 2/3 and class 3's embedding gets only weight decay."""
    labels = [0, 0, 0, 2, 0, 2, 0, 0, 0, 0, 2, 0]
    params, images, labels = make_problem(conditional=True, seed=3, labels=labels)
    weights = np.asarray(adversarial.class_balance_weights(jnp.asarray(labels)))
    np.testing.assert_allclose(weights.sum(), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(weights[labels == 2], 1 / (3 * 3), rtol=1e-6)
    present = adversarial.class_balance_weights(jnp.asarray(labels), "present")
    np.testing.assert_allclose(float(present.sum()), 1.0, rtol=1e-6)
    check_against_reference("cdann", {**HP, "d_steps_per_g_step": 2}, params, images, labels)


def test_discriminator_dropout_draws_from_the_key():
    layers = adversarial.mlp_init(jax.random.PRNGKey(0), DIM, M, 16, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (6, DIM))
    apply = jax.jit(adversarial.mlp_apply, static_argnums=2)
    a, b = apply(layers, x, 0.5, jax.random.PRNGKey(2)), apply(layers, x, 0.5,
                                                             jax.random.PRNGKey(3))
    np.testing.assert_array_equal(a, apply(layers, x, 0.5, jax.random.PRNGKey(2)))
    assert not np.allclose(a, b)
    with jax.enable_x64(True):
        want = ref_mlp(jax.tree.map(lambda v: np.asarray(v, np.float64), layers),
                       np.asarray(x, np.float64))
    np.testing.assert_allclose(apply(layers, x, 0.0, jax.random.PRNGKey(2)), want, **TOL)


def ops_under_control_flow(jaxpr, inside=False) -> set:
    """The primitives of ``jaxpr`` that run inside a ``cond``, ``while`` or ``scan``
    (nested calls such as ``pjit`` or ``custom_vjp_call`` are looked through)."""
    found = set()
    for eqn in jaxpr.eqns:
        if inside:
            found.add(eqn.primitive.name)
        nested = inside or eqn.primitive.name in ("cond", "while", "scan")
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(sub, "eqns"):
                    found |= ops_under_control_flow(sub, nested)
    return found


def conv_forward_at(params, dropout_key):
    """``forward_at`` with a convolution in the featurizer (a 2x2 kernel over the image)."""
    del dropout_key

    def forward(images):
        kernel = params["featurizer"]["kernel"].reshape(HEIGHT, WIDTH, 1, DIM)
        h = jax.lax.conv_general_dilated(images, kernel, (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        features = jnp.tanh(h.reshape(h.shape[0], -1) + params["featurizer"]["bias"])
        return Outputs(features, networks.classify(params, features), {},
                       lambda f: networks.classify(params, f))

    return forward


@pytest.mark.parametrize("name", ["dann", "cdann"])
def test_network_passes_stay_outside_control_flow(name):
    """XLA's CPU backend runs the convolutions inside a conditional's branch in a slow
    generic form (a RotatedDigits generator step took 1.5 s instead of 0.05 s,
    docs/performance.md), so both kinds of step share the network's pass and only the
    optimizer updates sit in the ``lax.cond``."""
    params, images, labels = make_problem(conditional=name == "cdann")
    procedure = procedures.make_procedure(name, HP, learning_rate=1.0, weight_decay=1.0,
                                          num_domains=M)

    def update(p, state, step, key):
        passes = procedures.BatchPasses(conv_forward_at, jnp.asarray(images),
                                        jnp.asarray(labels), M, step)
        return procedure.update(p, state, passes, key)

    jaxpr = jax.make_jaxpr(update)(params, procedure.init(params), jnp.int32(0),
                                   jax.random.PRNGKey(0))
    assert "conv_general_dilated" not in ops_under_control_flow(jaxpr.jaxpr)
    convolutions = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert convolutions  # the pass is traced where the test looks
