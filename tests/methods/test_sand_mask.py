"""SAND-mask (sagm_jax.methods.sand_mask) against a float64 NumPy re-statement of
DomainBed's ``SANDMask.update`` and ``SANDMask.mask_grads`` (``domainbed/algorithms.py``),
on softmax regression (W [d, C], b [C]) whose per-domain cross-entropy gradient is
closed-form: dW = X^T (softmax - onehot) / n, db = mean(softmax - onehot). The NumPy side
has its own PyTorch Adam (coupled L2) and writes torch's NaN/inf rules out
(``var(unbiased)`` of one row is NaN, ``x / 0 = inf``, ``inf * 0 = NaN``,
``torch.max`` keeps NaN). Plus a RotatedDigits run and the sweep's draws."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import digits_config

from sagm_jax import methods
from sagm_jax.methods import procedures, sand_mask
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train

D, C, ROWS, M = 3, 2, 4, 3
LR, WD = 0.05, 0.3
TOL = {"rtol": 2e-4, "atol": 2e-6}


def np_loss_grad(params, x, y):
    logits = x @ params["W"] + params["b"]
    logits = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    onehot = np.eye(C)[y]
    loss = -np.mean(np.log(prob[np.arange(len(y)), y]))
    return loss, {"W": x.T @ (prob - onehot) / len(y), "b": (prob - onehot).mean(axis=0)}


def np_adam(params, grads, state, lr=LR, wd=WD):
    """torch.optim.Adam, betas (0.9, 0.999), eps 1e-8, g + wd * w in the moments."""
    t = state["t"] + 1
    new, m, v = {}, {}, {}
    for k in params:
        g = grads[k] + wd * params[k]
        m[k] = 0.9 * state["m"][k] + 0.1 * g
        v[k] = 0.999 * state["v"][k] + 0.001 * g * g
        new[k] = params[k] - lr * (m[k] / (1 - 0.9**t)) / (
            np.sqrt(v[k] / (1 - 0.999**t)) + 1e-8)
    return new, {"t": t, "m": m, "v": v}


def np_mask_one(grads, tau, k):
    """``mask_grads`` on one parameter: ``grads`` [M, ...] float64."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n = grads.shape[0]
        avg = grads.mean(axis=0)
        var = (((grads - avg) ** 2).sum(axis=0) / (n - 1) if n > 1
               else np.full(avg.shape, np.nan))
        var[np.isnan(var)] = 1e-17
        lam = np.float64(1.0) / var
        mask = np.tanh(k * lam * (np.abs(np.sign(grads).mean(axis=0)) - tau))
        mask = np.where(np.isnan(mask), mask, np.maximum(mask, 0.0))
        mask[np.isnan(mask)] = 1e-17
        return mask * avg / (1e-10 + mask.sum() / mask.size)


def data(seed):
    rng = np.random.RandomState(seed)
    params = {"W": rng.normal(size=(D, C)), "b": rng.normal(size=C)}
    xs = rng.normal(size=(M, ROWS, D))
    ys = rng.randint(0, C, size=(M, ROWS))
    return params, xs, ys


def run_package(hp, params, xs, ys, steps):
    """``steps`` jitted updates of the registered procedure: float64 params and losses."""
    xs32, ys32 = jnp.asarray(xs, jnp.float32), jnp.asarray(ys)

    def ce(p, x, y):
        logp = jax.nn.log_softmax(x @ p["W"] + p["b"])
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def dvg(p, m):
        return jax.value_and_grad(ce)(p, xs32[m], ys32[m])

    proc = procedures.make_procedure("sand_mask", hp, learning_rate=LR, weight_decay=WD,
                                     num_domains=M)
    step = jax.jit(lambda p, s, key: proc.update(p, s, dvg, key))
    p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state, history = proc.init(p), []
    for _ in range(steps):
        updates, state, metrics = step(p, state, jax.random.PRNGKey(0))
        p = jax.tree.map(jnp.add, p, updates)
        history.append(({k: np.asarray(v, np.float64) for k, v in p.items()},
                        {k: float(v) for k, v in metrics.items()}))
    return history


@pytest.mark.parametrize("tau,k", [(0.5, 0.05), (0.2, 0.003)])
def test_sand_mask_three_steps_are_domainbeds(tau, k):
    """Three steps: the masked gradient of every tensor, the persistent Adam and the
    reported mean loss. At tau 0.5 an entry whose three signs split 2:1 (s = 1/3) is
    masked out, one where they agree gets tanh(k (1 - 0.5) / var) in (0, 1)."""
    params, xs, ys = data(seed=int(10 * tau))
    got = run_package({"sand_mask_tau": tau, "sand_mask_k": k}, params, xs, ys, steps=3)
    want = dict(params)
    state = {"t": 0, "m": {n: 0 * v for n, v in params.items()},
             "v": {n: 0 * v for n, v in params.items()}}
    partial = 0
    for got_params, got_metrics in got:
        losses, grads = zip(*(np_loss_grad(want, x, y) for x, y in zip(xs, ys)))
        masked = {n: np_mask_one(np.stack([g[n] for g in grads]), tau, k) for n in want}
        mean = {n: np.mean([g[n] for g in grads], axis=0) for n in want}
        partial += sum(int(np.any(masked[n] == 0) and np.any(masked[n] != 0)) for n in want)
        assert not np.allclose(masked["W"], mean["W"])  # the mask does something
        want, state = np_adam(want, masked, state)
        assert set(got_metrics) == {"loss"}
        np.testing.assert_allclose(got_metrics["loss"], np.mean(losses), rtol=1e-5)
        for n in want:
            np.testing.assert_allclose(got_params[n], want[n], **TOL, err_msg=n)
    if tau == 0.5:
        assert partial  # some tensor is masked in part: both branches are compared


def test_mask_edge_cases_follow_torch_nan_and_inf_rules():
    """Zero variance with full agreement at tau = 1 is inf * 0 = NaN -> 1e-17; zero
    variance with s < tau is tanh(-inf) -> 0; all-zero gradients are s = 0 -> 0; one
    domain has a NaN variance -> 1e-17; at tau = 1 differing gradients get mask 0."""
    # dyadic values: their mean and variance are exact, so a zero variance is exactly 0
    same = np.array([[0.25, -0.5, 0.0, 0.5], [0.25, -0.5, 0.0, 0.75], [0.25, -0.5, 0.0, 0.625]])
    with jax.enable_x64(True):
        for tau in (1.0, 0.5):
            got = np.asarray(sand_mask.sand_mask_tensor(jnp.asarray(same), tau, 10.0))
            want = np_mask_one(same, tau, 10.0)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        at_one = np_mask_one(same, 1.0, 10.0)
        # entries 0, 1: NaN -> 1e-17 each; 2: zero gradient; 3: masked (var > 0, s = 1)
        np.testing.assert_allclose(at_one[:2], same[0, :2] * 1e-17 / (1e-10 + 2e-17 / 4))
        assert at_one[2] == 0 and at_one[3] == 0
        one = np.array([[0.4, -0.1]])
        got = np.asarray(sand_mask.sand_mask_tensor(jnp.asarray(one), 0.5, 2.0))
        np.testing.assert_allclose(got, np_mask_one(one, 0.5, 2.0), rtol=1e-12)
    assert np.all(np.isfinite(got))


def test_registry_entry_and_a_rotated_digits_run(tmp_path):
    rule = methods.update_rule("sand_mask")
    assert rule.kind == "procedure" and rule.network is None
    assert {h.key: (h.default, h.distribution.text) for h in rule.method.hyperparameters} == {
        "sand_mask_tau": (1.0, "U(0,1)"), "sand_mask_k": (10.0, "10^U(-3,5)")}
    records = train.train_and_evaluate(
        digits_config(algorithm="sand_mask", sand_mask_tau=0.3, steps=2, eval_every=1),
        str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r["loss"]) for r in records)


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


@pytest.mark.parametrize("hparams_seed", [0, 3, 11])
def test_sweep_draws_sand_masks_hyperparameters_under_domainbeds_names(hparams_seed):
    """DomainBed's ``hparams_registry`` for SANDMask: tau U(0, 1), k 10^U(-3, 5), each
    from RandomState(seed_hash(s, name)) with DomainBed's names tau and k."""
    got = random_hparams("sand_mask", "PACS", hparams_seed, 2)
    if hparams_seed == 0:
        want = {"sand_mask_tau": 1.0, "sand_mask_k": 10.0}
    else:
        s = db_seed_hash(hparams_seed, 2)

        def draw(name):
            return np.random.RandomState(db_seed_hash(s, name))

        want = {"sand_mask_tau": draw("tau").uniform(0.0, 1.0),
                "sand_mask_k": 10 ** draw("k").uniform(-3, 5)}
    assert {key: got[key] for key in want} == want


def test_records_name_the_algorithm_as_domainbed_does():
    """DomainBed's ``collect_results`` reads ``args.algorithm``: its class names."""
    from sagm_jax.training import rundir

    assert rundir.record_algorithm({"algorithm": "sand_mask", "objective": "erm"}) == "SANDMask"
    assert rundir.record_algorithm({"algorithm": "transfer", "objective": "erm"}) == "Transfer"
