"""TRM (sagm_jax.methods.trm) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` (class ``TRM``: ``update`` and ``neum``), written here
independently of the package: the heads as a list of (W, b), each fitted by its own
30 SGD(0.1) steps; the Hessian of each head's loss built in full (``jax.hessian`` of the
flattened weight) and the Neumann loop written as the reference writes it with NumPy's
in-place ``-=`` (so its aliasing happens as it does in PyTorch); the transfer risk
differentiated by ``jax.grad`` through the features; ``alpha`` as a NumPy matrix; and
the reference's two Adams, ``optimizer_f`` over the featurizer and ``optimizer_c`` over
the classifier, each with its own state. The network is a tiny dense featurizer and
classifier; whole train steps run through ``make_train_step``; the sweep's draws of TRM's
hyperparameters under DomainBed's names. (TRM trains end to end on RotatedDigits, killed
and resumed, in tests/methods/test_method_runs.py.)
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, tanh_net, torch_adam

from sagm_jax import methods
from sagm_jax.methods import networks, trm
from sagm_jax.methods.procedures import make_procedure
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 2, 2, 4, 3
M, B = 3, 4  # domains, rows per domain
LR, WD = 0.01, 0.1
TOL = {"rtol": 2e-4, "atol": 2e-6}


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def trm_hp(**overrides):
    hp = {"trm_cos_lambda": 2.0, "trm_iters": 1, "groupdro_eta": 0.3,
          "trm_class_balanced": False, "trm_fix_neumann": False}
    return {**hp, **overrides}


def run_steps(hp, steps=3):
    net = TanhNet(DIM, CLASSES)
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    rule = methods.update_rule("trm")
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    own = networks.init_method_variables(rule.network, jax.random.key(1), shapes, hp)
    variables = networks.with_method_variables(dict(variables), own)
    procedure = make_procedure("trm", hp, learning_rate=LR, weight_decay=WD, num_domains=M)
    step = jax.jit(make_train_step(net, procedure, algorithm="trm",
                                   method=StepMethod("erm", {}, M)))
    states, metrics = [create_train_state(variables, procedure, {})], []
    for t in range(steps):
        state, m = step(states[-1], batch(M * B, seed=t), jax.random.key(7))
        states.append(state)
        metrics.append({k: float(v) for k, v in m.items()})
    return states, metrics


# ---------------------------------------------------------------- float64 re-statement


def head_ce(w, b, z, y):
    return jnp.mean(ref_ce(z @ w + b, y))


head_grads = jax.jit(jax.grad(head_ce, argnums=(0, 1)))
full_hessian = jax.jit(lambda w, b, z, y: jax.hessian(
    lambda flat: head_ce(flat.reshape(w.shape), b, z, y))(w.reshape(-1)))


def ref_neum(v, w, b, z, y):
    """``TRM.neum`` line by line: NumPy's ``v -= hv`` is in place, as torch's is, so
    ``h_estimate = v`` sees it on the first pass; H is the full Hessian in ``w``."""
    hessian = np.asarray(full_hessian(jnp.asarray(w), b, z, y))
    v = np.array(v, np.float64).reshape(-1)
    h_estimate = v
    for _ in range(10):
        hv = hessian @ v
        v -= hv
        h_estimate = v + h_estimate
        if np.max(np.abs(h_estimate)) > 10:
            break
    return h_estimate.reshape(w.shape)


@jax.jit
def ref_grad_p(w, b, alpha_row, zs, ys, q_mask):
    """d/dW of sum_{i != q} alpha_qi CE(h_q(z_i), y_i) (loss_P_sum's gradient)."""
    return jax.grad(lambda w_: sum(alpha_row[i] * q_mask[i] * head_ce(w_, b, zs[i], ys[i])
                                   for i in range(M)))(w)


def nll_of(p, x, y):
    return jnp.mean(ref_ce(tanh_net(p, x)[1], y)), None


def trm_total(p, ws, bs, vectors, alpha, cos_lambda, x, y):
    """nll + loss_swap / M as the reference sums it, and the weighted losses loss_P."""
    z, logits = tanh_net(p, x)
    nll = jnp.mean(ref_ce(logits, y))
    swap, loss_p = 0.0, []
    for q in range(M):
        zq, yq = z[q * B:(q + 1) * B], y[q * B:(q + 1) * B]
        grad_q = jax.grad(head_ce)(ws[q], bs[q], zq, yq)
        terms = [alpha[q, i] * head_ce(ws[q], bs[q], z[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
                 if i != q else jnp.zeros(()) for i in range(M)]
        swap = swap + sum(terms) - cos_lambda * jnp.sum(vectors[q] * grad_q)
        loss_p.append(jnp.stack(terms))
    return nll + swap / M, (nll, jnp.stack(loss_p))


erm_value_and_grad = jax.jit(jax.value_and_grad(nll_of, has_aux=True))
trm_value_and_grad = jax.jit(jax.value_and_grad(trm_total, has_aux=True))


def ref_step(p, heads, alpha, states, x, y, t, hp):
    """One ``TRM.update`` at ``update_count = t``: the new network, heads, alpha, Adam
    states and ``{'nll', 'trm_loss'}``."""
    zs_rows = [slice(j * B, (j + 1) * B) for j in range(M)]
    ys = np.stack([y[r] for r in zs_rows])
    if t >= hp["trm_iters"]:
        if hp["trm_class_balanced"]:
            heads = [(np.array(p["classifier"]["kernel"]), b) for _, b in heads]
        alpha = alpha / alpha.sum(1, keepdims=True)
        z = np.asarray(tanh_net(p, x)[0])
        zs = np.stack([z[r] for r in zs_rows])
        for _ in range(30):  # loss_erm over the domains, each head's SGD(0.1)
            grads = [head_grads(w, b, zs[j], ys[j]) for j, (w, b) in enumerate(heads[:M])]
            heads = [(w - 0.1 * np.asarray(gw), b - 0.1 * np.asarray(gb))
                     for (w, b), (gw, gb) in zip(heads[:M], grads)] + heads[M:]
        vectors = [ref_neum(ref_grad_p(w, b, alpha[q], zs, ys, np.arange(M) != q), w, b,
                            zs[q], ys[q]) for q, (w, b) in enumerate(heads[:M])]
        (loss, (nll, loss_p)), grads = trm_value_and_grad(
            p, [w for w, _ in heads], [b for _, b in heads], vectors, alpha,
            hp["trm_cos_lambda"], x, y)
        loss_p = np.asarray(loss_p)
        for q in range(M):
            for i in range(M):
                if i != q:
                    alpha[q, i] *= np.exp(hp["groupdro_eta"] * loss_p[q, i])
    else:
        (loss, _), grads = erm_value_and_grad(p, x, y)
        nll = loss
    body, states[0] = torch_adam(p["body"], grads["body"], states[0], LR, WD)
    classifier, states[1] = torch_adam(p["classifier"], grads["classifier"], states[1], LR, WD)
    reported = {"nll": float(nll), "trm_loss": float(loss) - float(nll)}
    return {"body": body, "classifier": classifier}, heads, alpha, states, reported


def reference(params, hp, steps=3):
    with jax.enable_x64(True):
        p = f64({k: params[k] for k in ("body", "classifier")})
        own = params["method"]["heads"]
        heads = [(np.asarray(own["kernel"][k], np.float64), np.asarray(own["bias"][k], np.float64))
                 for k in range(M + 1)]
        alpha = np.ones((M, M)) - np.eye(M)
        states, history = [adam_init(p["body"]), adam_init(p["classifier"])], []
        for t in range(steps):
            b = batch(M * B, seed=t)
            p, heads, alpha, states, reported = ref_step(
                p, heads, alpha, states, jnp.asarray(b["image"], jnp.float64),
                np.asarray(b["label"]), t, hp)
            history.append((p, [tuple(np.array(a) for a in h) for h in heads], alpha.copy(),
                            reported))
        return history


def check_against_reference(hp):
    states, metrics = run_steps(hp)
    expected = reference(states[0].params, hp)
    for t, (p, heads, alpha, reported) in enumerate(expected):
        got = states[t + 1]
        for name in ("body", "classifier"):
            jax.tree.map(lambda a, r, n=f"step {t} {name}": np.testing.assert_allclose(
                np.asarray(a), r, **TOL, err_msg=n), got.params[name], p[name])
        own = got.params["method"]["heads"]
        for k, (w, b) in enumerate(heads):
            np.testing.assert_allclose(own["kernel"][k], w, **TOL, err_msg=f"step {t} head {k}")
            np.testing.assert_allclose(own["bias"][k], b, **TOL, err_msg=f"step {t} head {k}")
        np.testing.assert_allclose(got.opt_state["alpha"], alpha, **TOL, err_msg=f"step {t}")
        for key, value in reported.items():
            np.testing.assert_allclose(metrics[t][key], value, **TOL, err_msg=f"step {t} {key}")
        assert metrics[t]["loss"] == pytest.approx(metrics[t]["nll"] + metrics[t]["trm_loss"])
    return states, metrics


# ---------------------------------------------------------------- tests


def test_registry_entry():
    rule = methods.update_rule("trm")
    assert rule.kind == "procedure" and rule.network.predict is None  # predicts c(phi(x))
    draws = {h.key: (h.default, h.distribution and h.distribution.text)
             for h in rule.method.hyperparameters}
    assert draws == {"trm_cos_lambda": (1e-4, "10^U(-5,0)"),
                     "trm_iters": (200, "int(10^U(0,4))"),
                     "groupdro_eta": (1e-2, "10^U(-3,-1)"),
                     "trm_class_balanced": (False, None), "trm_fix_neumann": (False, None)}


def test_three_steps_match_domainbeds_update():
    """Step 0 is ERM (the heads stay at init, alpha stays 1 - I, trm_loss 0); steps 1
    and 2 fit the heads, weight the transfer risks and move alpha; the last head never
    moves; the network's Adam stepped 3 times."""
    states, metrics = check_against_reference(trm_hp())
    heads = [s.params["method"]["heads"] for s in states]
    np.testing.assert_array_equal(heads[1]["kernel"], heads[0]["kernel"])
    assert metrics[0]["trm_loss"] == 0.0 and metrics[1]["trm_loss"] != 0.0
    assert not np.allclose(heads[2]["kernel"][:M], heads[1]["kernel"][:M])
    np.testing.assert_array_equal(heads[-1]["kernel"][M], heads[0]["kernel"][M])
    counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(states[-1].opt_state)
              if "count" in jax.tree_util.keystr(path)]
    assert counts and all(int(c) == 3 for c in counts)


def test_class_balanced_and_the_fixed_series_match_their_restatement():
    """class_balanced copies the classifier's weight into the heads each TRM step; the
    fixed Neumann series is checked on its own below (the reference has no fix)."""
    check_against_reference(trm_hp(trm_class_balanced=True, trm_iters=0))


def test_hessian_vector_product_is_a_finite_difference_of_the_gradient():
    rng = np.random.default_rng(5)
    w, b = rng.normal(size=(DIM, CLASSES)), rng.normal(size=CLASSES)
    z, y, v = rng.normal(size=(6, DIM)), rng.integers(0, CLASSES, 6), rng.normal(size=(DIM, CLASSES))
    with jax.enable_x64(True):
        got = trm.hessian_vector_product(w, b, z, y)(v)
        grad = jax.grad(head_ce)
        eps = 1e-5
        want = (np.asarray(grad(w + eps * v, b, z, y)) - np.asarray(grad(w - eps * v, b, z, y))) / (2 * eps)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("scale", [0.5, 40.0])  # 0.5: all 10 terms; 40: stops early
def test_neumann_series_is_the_references(scale):
    """The reference's aliasing (2 v_1 + v_2 + ...), its stop once max |sum| > 10, and
    the fix (v_0 + v_1 + ...) against the series summed from the full Hessian."""
    rng = np.random.default_rng(6)
    w, b = rng.normal(size=(DIM, CLASSES)), rng.normal(size=CLASSES)
    z, y = rng.normal(size=(8, DIM)) * 0.7, rng.integers(0, CLASSES, 8)
    g = scale * rng.normal(size=(DIM, CLASSES))
    with jax.enable_x64(True):
        neumann = jax.jit(trm.neumann, static_argnums=5)
        got, fixed = neumann(g, w, b, z, y, False), neumann(g, w, b, z, y, True)
        want = ref_neum(g, w, b, z, y)
        hessian = np.asarray(jax.hessian(
            lambda f: head_ce(f.reshape(w.shape), b, z, y))(jnp.asarray(w).reshape(-1)))
    terms = [g.reshape(-1)]
    for _ in range(10):
        terms.append(terms[-1] - hessian @ terms[-1])
    sums = np.cumsum(terms, axis=0)  # v_0 + ... + v_k
    stop = next((k for k in range(1, 11) if np.max(np.abs(sums[k] - terms[0] + terms[1])) > 10), 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # the package: float32
    np.testing.assert_allclose(np.asarray(got).reshape(-1), sums[stop] - terms[0] + terms[1],
                               rtol=1e-5, atol=1e-6)
    stop_fixed = next((k for k in range(1, 11) if np.max(np.abs(sums[k])) > 10), 10)
    np.testing.assert_allclose(np.asarray(fixed).reshape(-1), sums[stop_fixed], rtol=1e-5,
                               atol=1e-6)
    assert (stop < 10) == (scale > 1)


def test_network_passes_stay_outside_control_flow():
    """The ERM/TRM branch is a ``lax.cond`` over the heads' arithmetic; the network's
    pass and its backward run once, outside it (docs/performance.md)."""
    from float64_reference import ConvTanhNet
    from test_adversarial import ops_under_control_flow

    net = ConvTanhNet(DIM, CLASSES, (HEIGHT, WIDTH))
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)),
                         train=False)
    own = trm.init_heads(jax.random.key(1),
                         networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M), {})
    variables = networks.with_method_variables(dict(variables), own)
    procedure = make_procedure("trm", trm_hp(), learning_rate=LR, weight_decay=WD, num_domains=M)
    step = make_train_step(net, procedure, algorithm="trm", method=StepMethod("erm", {}, M))
    jaxpr = jax.make_jaxpr(step)(create_train_state(variables, procedure, {}),
                                 {"image": np.zeros((M * 2, HEIGHT, WIDTH, CHANNELS),
                                                    np.float32),
                                  "label": np.zeros(M * 2, np.int32)}, jax.random.key(7))
    assert "conv_general_dilated" not in ops_under_control_flow(jaxpr.jaxpr)
    assert any(e.primitive.name == "conv_general_dilated" for e in jaxpr.jaxpr.eqns)


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


@pytest.mark.parametrize("hparams_seed", [0, 3])
def test_sweep_draws_trms_hyperparameters_under_domainbeds_names(hparams_seed):
    """DomainBed's ``hparams_registry`` for TRM: cos_lambda 10^U(-5,0), iters
    int(10^U(0,4)), groupdro_eta 10^U(-3,-1), each from RandomState(seed_hash(s, name))."""
    got = random_hparams("trm", "PACS", hparams_seed, 1)
    if hparams_seed == 0:
        want = {"trm_cos_lambda": 1e-4, "trm_iters": 200, "groupdro_eta": 1e-2}
    else:
        s = db_seed_hash(hparams_seed, 1)

        def draw(name):
            return np.random.RandomState(db_seed_hash(s, name))

        want = {"trm_cos_lambda": 10 ** draw("cos_lambda").uniform(-5, 0),
                "trm_iters": int(10 ** draw("iters").uniform(0, 4)),
                "groupdro_eta": 10 ** draw("groupdro_eta").uniform(-3, -1)}
    assert {k: got[k] for k in want} == want
    assert "trm_fix_neumann" not in got  # no DomainBed draw: the config's value stays


def test_records_name_the_algorithm_as_domainbed_does():
    """DomainBed's ``collect_results`` reads ``args.algorithm``: its class name ``TRM``."""
    from sagm_jax.training import rundir

    assert rundir.record_algorithm({"algorithm": "trm", "objective": "erm"}) == "TRM"
