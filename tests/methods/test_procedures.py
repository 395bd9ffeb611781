"""Fish, AND-mask and MLDG against a float64 NumPy re-statement of DomainBed's
``domainbed/algorithms.py`` (``Fish``, ``ANDMask``, ``MLDG``), on softmax regression
(W [d, C], b [C]) whose cross-entropy gradient is closed-form:
dW = X^T (softmax - onehot) / n, db = mean(softmax - onehot). The NumPy side has its own
PyTorch Adam (coupled L2); every update runs under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import methods
from sagm_jax.methods import procedures

D, C, ROWS = 3, 2, 4
LR, WD = 0.05, 0.3
TOL = dict(rtol=1e-4, atol=2e-6)


# ---------------------------------------------------------------- NumPy re-statement


def np_loss_grad(params, x, y):
    logits = x @ params["W"] + params["b"]
    logits = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    onehot = np.eye(C)[y]
    loss = -np.mean(np.log(prob[np.arange(len(y)), y]))
    return loss, {"W": x.T @ (prob - onehot) / len(y), "b": (prob - onehot).mean(axis=0)}


def np_adam_init(params):
    return {"t": 0, "m": {k: np.zeros_like(v) for k, v in params.items()},
            "v": {k: np.zeros_like(v) for k, v in params.items()}}


def np_adam_step(params, grads, state, lr=LR, wd=WD):
    """torch.optim.Adam: g + wd * w enters the moments; bias-corrected; eps 1e-8."""
    t = state["t"] + 1
    new, m_new, v_new = {}, {}, {}
    for k in params:
        g = grads[k] + wd * params[k]
        m_new[k] = 0.9 * state["m"][k] + 0.1 * g
        v_new[k] = 0.999 * state["v"][k] + 0.001 * g * g
        m_hat, v_hat = m_new[k] / (1 - 0.9**t), v_new[k] / (1 - 0.999**t)
        new[k] = params[k] - lr * m_hat / (np.sqrt(v_hat) + 1e-8)
    return new, {"t": t, "m": m_new, "v": v_new}


def np_fish_step(params, state, xs, ys, meta_lr):
    inner = dict(params)
    for x, y in zip(xs, ys):
        loss, grads = np_loss_grad(inner, x, y)
        inner, state = np_adam_step(inner, grads, state)
    return {k: params[k] + meta_lr * (inner[k] - params[k]) for k in params}, state, loss


def np_and_mask_grad(domain_grads, tau):
    out = {}
    for k in domain_grads[0]:
        g = np.stack([dg[k] for dg in domain_grads])
        mask = (np.abs(np.sign(g).mean(axis=0)) >= tau).astype(np.float64)
        out[k] = mask * g.mean(axis=0) / (1e-10 + mask.mean())
    return out


def np_mldg_grad(params, xs, ys, perm, beta, n, divide_by=None):
    M = len(xs)
    divide_by = M if divide_by is None else divide_by
    tr, te = perm[: M - n], perm[M - n:]
    total = {k: np.zeros_like(v) for k, v in params.items()}
    rep = 0.0
    for k in range(M - n):
        i, j = tr[k], te[k % n]
        loss_i, g_i = np_loss_grad(params, xs[i], ys[i])
        inner, _ = np_adam_step(params, g_i, np_adam_init(params))  # a fresh inner Adam
        loss_j, g_j = np_loss_grad(inner, xs[j], ys[j])
        for key in total:
            total[key] += g_i[key] / divide_by + beta * g_j[key] / divide_by
        rep += loss_i + beta * loss_j
    return total, rep / divide_by


# ---------------------------------------------------------------- JAX side


def jax_dvg(xs, ys):
    xs, ys = jnp.asarray(xs, jnp.float32), jnp.asarray(ys)

    def ce(p, x, y):
        logp = jax.nn.log_softmax(x @ p["W"] + p["b"])
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    return lambda params, m: jax.value_and_grad(ce)(params, xs[m], ys[m])


def run_steps(proc, params, xs, ys, keys):
    """``len(keys)`` jitted updates; returns the float64 params, state and losses per step."""
    dvg = jax_dvg(xs, ys)
    step = jax.jit(lambda p, s, k: proc.update(p, s, dvg, k))
    p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state, history = proc.init(p), []
    for key in keys:
        updates, state, metrics = step(p, state, key)
        p = jax.tree.map(lambda w, u: w + u, p, updates)
        history.append(({k: np.asarray(v, np.float64) for k, v in p.items()},
                        float(metrics["loss"])))
    return history


def data(num_domains, seed=0):
    rng = np.random.RandomState(seed)
    params = {"W": rng.normal(size=(D, C)), "b": rng.normal(size=C)}
    xs = rng.normal(size=(num_domains, ROWS, D))
    ys = rng.randint(0, C, size=(num_domains, ROWS))
    return params, xs, ys


def assert_params_close(got, want, **tol):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], **(tol or TOL), err_msg=k)


def max_gap(a, b):
    return max(np.max(np.abs(a[k] - b[k])) for k in a)


# ---------------------------------------------------------------- registry


def test_names_match_the_methods_table_and_unknown_names_fail():
    assert methods.rule_names("procedure")[:3] == ("fish", "and_mask", "mldg")
    with pytest.raises(ValueError, match="sagm is a head update rule, not a procedure"):
        procedures.make_procedure("sagm", {}, learning_rate=LR, weight_decay=WD, num_domains=3)
    with pytest.raises(ValueError, match="unknown update rule 'fishy'; choose one of erm"):
        procedures.make_procedure("fishy", {}, learning_rate=LR, weight_decay=WD, num_domains=3)


# ---------------------------------------------------------------- Fish


def test_fish_persistent_inner_adam_over_three_steps():
    params, xs, ys = data(3)
    proc = procedures.make_procedure("fish", {"fish_meta_lr": 0.5, "lr": 123.0},
                                     learning_rate=LR, weight_decay=WD, num_domains=3)
    got = run_steps(proc, params, xs, ys, [jax.random.PRNGKey(0)] * 3)

    persistent, fresh = dict(params), dict(params)
    state = np_adam_init(params)
    for step, (got_params, got_loss) in enumerate(got):
        persistent, state, loss = np_fish_step(persistent, state, xs, ys, 0.5)
        assert_params_close(got_params, persistent)
        np.testing.assert_allclose(got_loss, loss, rtol=1e-5)  # l_(M-1), before its step
        fresh, _, _ = np_fish_step(fresh, np_adam_init(params), xs, ys, 0.5)
        if step == 0:
            assert_params_close(got_params, fresh)
        else:  # a fresh inner Adam each step is a different algorithm
            assert max_gap(got_params, fresh) > 100 * TOL["atol"]
    assert state["t"] == 9  # the inner count grows by M per step


def test_fish_reports_the_last_domain_loss_before_its_inner_step():
    params, xs, ys = data(3, seed=1)
    proc = procedures.fish(0.1, learning_rate=LR, weight_decay=0.0, num_domains=3)
    (_, loss), = run_steps(proc, params, xs, ys, [jax.random.PRNGKey(0)])
    inner, state = dict(params), np_adam_init(params)
    for x, y in zip(xs[:2], ys[:2]):
        inner, state = np_adam_step(inner, np_loss_grad(inner, x, y)[1], state, wd=0.0)
    np.testing.assert_allclose(loss, np_loss_grad(inner, xs[2], ys[2])[0], rtol=1e-5)
    assert abs(loss - np_loss_grad(params, xs[2], ys[2])[0]) > 1e-3


# ---------------------------------------------------------------- AND-mask


def disagreeing_b_data():
    """Domains 0 and 2 are all class 0, domain 1 all class 1, so db's signs are (-, +, -)
    for class 0 and (+, -, +) for class 1 at ANY weights: b is masked for tau > 1/3.
    Feature 0 is positive everywhere (W[0] disagrees like b); feature 1 flips sign with
    the class (W[1] agrees); feature 2 is random."""
    rng = np.random.RandomState(3)
    params = {"W": rng.normal(size=(D, C)), "b": rng.normal(size=C)}
    ys = np.array([[0] * ROWS, [1] * ROWS, [0] * ROWS])
    xs = rng.normal(size=(3, ROWS, D))
    xs[:, :, 0] = np.abs(xs[:, :, 0]) + 0.1
    xs[:, :, 1] = (np.abs(xs[:, :, 1]) + 0.1) * np.where(ys == 0, 1.0, -1.0)
    return params, xs, ys


@pytest.mark.parametrize("tau", [0.3, 1.0])
def test_and_mask_two_steps_with_a_fully_masked_tensor(tau):
    params, xs, ys = disagreeing_b_data()
    proc = procedures.make_procedure("and_mask", {"and_mask_tau": tau},
                                     learning_rate=LR, weight_decay=WD, num_domains=3)
    got = run_steps(proc, params, xs, ys, [jax.random.PRNGKey(0)] * 2)

    want, state = dict(params), np_adam_init(params)
    decay_only, decay_state = {"b": params["b"]}, np_adam_init({"b": params["b"]})
    for got_params, got_loss in got:
        losses, grads = zip(*(np_loss_grad(want, x, y) for x, y in zip(xs, ys)))
        masked = np_and_mask_grad(grads, tau)
        if tau == 1.0:  # the fixture does what it says: b fully masked, W partly
            assert not masked["b"].any() and 0 < np.mean(masked["W"] != 0) < 1
            decay_only, decay_state = np_adam_step(decay_only, {"b": 0 * params["b"]},
                                                   decay_state)
            np.testing.assert_allclose(got_params["b"], decay_only["b"], **TOL)
        else:  # every s >= 1/3 passes tau 0.3
            assert np.all(masked["W"] != 0) and np.all(masked["b"] != 0)
        want, state = np_adam_step(want, masked, state)
        assert_params_close(got_params, want)
        np.testing.assert_allclose(got_loss, np.mean(losses), rtol=1e-5)


def test_and_mask_gradient_five_domains_splits_on_tau():
    rng = np.random.RandomState(7)
    grads = [{"W": rng.normal(size=(6, 5)), "b": rng.normal(size=4)} for _ in range(5)]
    grads[2]["b"][1] = 0.0  # sign(0) = 0: s = 1/5 of the other four's sum
    agreement = np.abs(np.sign(np.stack([g["W"] for g in grads])).mean(axis=0))
    assert set(np.round(agreement.ravel(), 6)) == {0.2, 0.6, 1.0}
    fn = jax.jit(procedures.and_mask_gradient, static_argnums=1)
    kept = {}
    for tau in (0.1, 0.5, 0.6, 0.7, 1.0):
        got = fn([jax.tree.map(jnp.float32, g) for g in grads], tau)
        want = np_and_mask_grad(grads, tau)
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-7)
        kept[tau] = np.count_nonzero(want["W"])
    # 0.1 keeps all; [0.5, 0.6] keeps s in {0.6, 1} (4 of 5 agree); above, only s = 1
    assert kept[0.1] == 30 > kept[0.5] == kept[0.6] > kept[0.7] == kept[1.0] > 0


# ---------------------------------------------------------------- MLDG


@pytest.mark.parametrize("num_domains,n", [(3, 1), (3, 2), (5, 2)])
def test_mldg_two_steps_with_the_drawn_permutation(num_domains, n):
    params, xs, ys = data(num_domains, seed=num_domains + n)
    proc = procedures.make_procedure(
        "mldg", {"mldg_beta": 0.7, "mldg_n_meta_test": n, "and_mask_tau": 0.2},
        learning_rate=LR, weight_decay=WD, num_domains=num_domains,
    )
    keys = [jax.random.PRNGKey(s) for s in (0, 5)]
    perms = [np.asarray(jax.random.permutation(k, num_domains)) for k in keys]
    assert not np.array_equal(perms[0], perms[1])  # the draw matters below
    got = run_steps(proc, params, xs, ys, keys)

    want, state = dict(params), np_adam_init(params)
    for (got_params, got_loss), perm in zip(got, perms):
        grad, rep = np_mldg_grad(want, xs, ys, perm, 0.7, n)
        other_split, _ = np_mldg_grad(want, xs, ys, perm[::-1], 0.7, n)
        assert max_gap(other_split, grad) > 1e-3  # the pairing is visible in G
        want, state = np_adam_step(want, grad, state)
        assert_params_close(got_params, want)
        np.testing.assert_allclose(got_loss, rep, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2])
def test_mldg_gradient_divides_by_the_number_of_domains(n):
    params, xs, ys = data(3, seed=11)
    key = jax.random.PRNGKey(2)
    fn = jax.jit(lambda p: procedures.mldg_gradient(
        p, jax_dvg(xs, ys), key, beta=0.7, n_meta_test=n, learning_rate=LR,
        weight_decay=WD, num_domains=3))
    got, rep = fn(jax.tree.map(jnp.float32, params))
    perm = np.asarray(jax.random.permutation(key, 3))
    want, want_rep = np_mldg_grad(params, xs, ys, perm, 0.7, n)
    assert_params_close({k: np.asarray(v) for k, v in got.items()}, want)
    np.testing.assert_allclose(float(rep), want_rep, rtol=1e-5)
    by_pairs, by_pairs_rep = np_mldg_grad(params, xs, ys, perm, 0.7, n, divide_by=3 - n)
    assert max_gap(by_pairs, want) > 1e-3 and abs(by_pairs_rep - want_rep) > 1e-2


@pytest.mark.parametrize("num_domains,n", [(2, 2), (3, 3), (1, 1)])
def test_mldg_refuses_a_split_without_meta_train_domains(num_domains, n):
    with pytest.raises(ValueError, match=r"config\.mldg_n_meta_test.*num_domains.*Lower"):
        procedures.make_procedure("mldg", {"mldg_n_meta_test": n}, learning_rate=LR,
                                  weight_decay=WD, num_domains=num_domains)
