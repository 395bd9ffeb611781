"""IGA (sagm_jax.methods.inter_gradient) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` (``IGA``) written here in JAX x64: each domain's own forward
and its gradient with respect to every parameter (``autograd.grad(..., create_graph=True)``
there, ``jax.grad`` inside the differentiated loss here), the mean loss's gradient held
constant (no ``create_graph`` there), the penalty summed over domains and coordinates,
the reported mean loss and penalty. The second-order term is checked against central
differences of the first-order penalty; whole train steps run through ``make_train_step``
under Adam and SAM; one short RotatedDigits run trains IGA; the sweep's draw is
DomainBed's ``hparams_registry``'s (``penalty``: 10^U(1, 5))."""

import hashlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, tanh_net, torch_adam
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from run_fixtures import digits_config, train_steps

from sagm_jax.methods import objectives
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 3, 2, 4, 3
M, B = 3, 4
LR, WD, RHO = 0.01, 0.05, 0.05
TOL = {"rtol": 2e-4, "atol": 2e-6}


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(seed):
    rng = np.random.default_rng(seed)
    scale = np.repeat(1.0 + np.arange(M), B)[:, None, None, None]  # the domains differ
    return {"image": (rng.normal(size=(M * B, HEIGHT, WIDTH, CHANNELS)) * scale
                      ).astype(np.float32),
            "label": rng.integers(0, CLASSES, M * B).astype(np.int32)}


def init():
    net = TinyNet()
    return net, net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), False)


# ---------------------------------------------------------------- float64 re-statement


def ref_env_loss(p, x, y):
    return ref_ce(tanh_net(p, x)[1], y).mean()


def ref_grads(p, x, y):
    """Each domain's gradient of its own loss, from its own forward."""
    rows = [slice(d * B, (d + 1) * B) for d in range(M)]
    return [jax.grad(ref_env_loss)(p, x[r], y[r]) for r in rows]


def ref_penalty(p, x, y, detach_mean=True):
    """sum over domains and parameters of (g_m - mean_grad)^2, mean_grad the gradient of
    the mean loss, a constant (``autograd.grad`` without ``create_graph``)."""
    mean_loss = lambda q: sum(ref_env_loss(q, x[d * B:(d + 1) * B], y[d * B:(d + 1) * B])
                              for d in range(M)) / M
    mean_grad = jax.grad(mean_loss)(p)
    if detach_mean:
        mean_grad = jax.lax.stop_gradient(mean_grad)
    total = 0.0
    for g in ref_grads(p, x, y):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(mean_grad), strict=True):
            total = total + jnp.sum((a - b) ** 2)
    return total


def ref_update(p, x, y, lam):
    """``IGA.update``'s objective and reported values: loss = the mean domain loss."""
    losses = [ref_env_loss(p, x[d * B:(d + 1) * B], y[d * B:(d + 1) * B]) for d in range(M)]
    mean_loss = sum(losses) / M
    penalty = ref_penalty(p, x, y)
    return mean_loss + lam * penalty, {"loss": mean_loss, "penalty": penalty}


def ours(p, x, y, lam, calls=None, dtype=jnp.float32, num_domains=M):
    """The package's IGA loss on the tiny network, as the train step calls it: the pass
    at ``q`` in ``dtype`` (each call recorded in ``calls``)."""
    net = TinyNet()

    def forward_at(q):
        def forward(images):
            if calls is not None:
                calls.append(images.shape)
            h, logits = net.apply({"params": jax.tree.map(lambda a: a.astype(dtype), q)},
                                  images.astype(dtype), False, features=True)
            return objectives.Outputs(h, logits, {"stats": 1})
        return forward

    return objectives.objective_loss(
        "iga", {"iga_penalty": lam}, forward_at(p), x, y, num_domains=num_domains, state={},
        step=jnp.int32(0), key=None, advance=True, params=p, forward_at=forward_at)


def test_second_order_term_is_the_finite_difference_of_the_penalty():
    """d/de P(w + e v) at e = 0 for a random direction v: the package's gradient of the
    penalty term (the loss's gradient at lambda = 1 less that at lambda = 0) against float64
    central differences of the first-order penalty P (gradients by ``jax.grad``, no
    second derivative anywhere). The reference's constant mean gradient changes nothing:
    its term sums the deviations, which is zero."""
    _, variables = init()
    data = batch(0)
    p32 = variables["params"]
    x32, y = jnp.asarray(data["image"]), jnp.asarray(data["label"])
    grad = jax.jit(jax.grad(lambda q, lam: ours(q, x32, y, lam)[0]))
    penalty_grad = jax.tree.map(lambda a, b: a - b, grad(p32, 1.0), grad(p32, 0.0))
    with jax.enable_x64(True):
        p, x = f64(p32), jnp.asarray(data["image"], jnp.float64)
        keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(p)))
        v = jax.tree.unflatten(jax.tree.structure(p), [
            jax.random.normal(k, a.shape, jnp.float64) for k, a in zip(keys, jax.tree.leaves(p))])
        eps = 1e-5
        penalty_at = jax.jit(lambda s: ref_penalty(
            jax.tree.map(lambda a, d: a + s * eps * d, p, v), x, y))
        numeric = (penalty_at(1.0) - penalty_at(-1.0)) / (2 * eps)
        analytic = sum(jnp.sum(np.asarray(a, np.float64) * d) for a, d in
                       zip(jax.tree.leaves(penalty_grad), jax.tree.leaves(v), strict=True))
        exact = jax.jit(jax.grad(lambda q: ref_penalty(q, x, y, detach_mean=False)))(p)
        full = sum(jnp.sum(a * d) for a, d in zip(jax.tree.leaves(exact), jax.tree.leaves(v)))
    assert abs(float(numeric)) > 1e-3  # a direction along which the penalty moves
    np.testing.assert_allclose(float(analytic), float(numeric), rtol=1e-4)
    np.testing.assert_allclose(float(full), float(numeric), rtol=1e-6)


@pytest.mark.parametrize("algorithm", ["erm", "sam"])
def test_three_steps_match_domainbeds_update(algorithm):
    """Loss, penalty and every parameter after each of 3 steps, weight decay on; under SAM
    the objective's whole (second-order) gradient is taken again at w + rho g / ||g||."""
    lam = 10.0
    net, variables = init()
    states, metrics = train_steps(net, variables, "iga", {"iga_penalty": lam}, 3, batch,
                                  num_domains=M, lr=LR, wd=WD, key=3, algorithm=algorithm,
                                  rule_hp={"rho": RHO})
    with jax.enable_x64(True):
        p, adam = f64(variables["params"]), adam_init(f64(variables["params"]))
        for t in range(3):
            data = batch(t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            value_and_grad = jax.jit(jax.value_and_grad(
                lambda q, a=x, b=y: ref_update(q, a, b, lam), has_aux=True))
            (_, reported), g = value_and_grad(p)
            if algorithm == "sam":
                norm = jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree.leaves(g)))
                g = value_and_grad(jax.tree.map(lambda w, d, n=norm: w + RHO * d / n, p, g))[1]
            p, adam = torch_adam(p, g, adam, LR, WD)
            assert set(metrics[t]) == set(reported)
            for key, want in reported.items():
                np.testing.assert_allclose(float(metrics[t][key]), float(want), **TOL,
                                           err_msg=f"step {t}: {key}")
            for got, want in zip(jax.tree.leaves(states[t + 1].params), jax.tree.leaves(p),
                                 strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL,
                                           err_msg=f"step {t}")


def test_one_pass_per_domain_float32_and_eight_devices_agree():
    """One call of the pass per domain, over that domain's rows (as the reference's
    ``self.network(x)`` per minibatch; M passes over the whole batch would cost M times
    the backward passes), for the loss and all M gradients; bfloat16 passes give float32
    loss, metrics and domain losses. With 24 rows sharded over 8 devices (domain
    boundaries inside shards) loss and gradient are the one-device ones: each g_m is of
    the whole domain."""
    _, variables = init()
    rng = np.random.default_rng(4)
    x = rng.normal(size=(M * 8, HEIGHT, WIDTH, CHANNELS)).astype(np.float32)
    y = rng.integers(0, CLASSES, M * 8).astype(np.int32)
    calls = []
    loss, aux = jax.eval_shape(lambda p: ours(p, x, y, 1.0, calls, jnp.bfloat16),
                               variables["params"])
    assert calls == [(8, *x.shape[1:])] * M and set(aux.batch_stats) == {"stats"}
    assert loss.dtype == jnp.float32 and aux.domain_losses.shape == (M,)
    assert {k: v.dtype for k, v in aux.metrics.items()} == {"loss": jnp.float32,
                                                            "penalty": jnp.float32}
    results = []
    for devices in (jax.devices()[:1], jax.devices()[:8]):
        mesh = Mesh(np.array(devices), ("batch",))
        rows, same = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
        args = (jax.device_put(variables["params"], same), jax.device_put(x, rows),
                jax.device_put(y, rows))
        results.append(jax.jit(jax.value_and_grad(
            lambda p, a, b: ours(p, a, b, 10.0)[0]))(*args))
    assert len(jax.devices()) == 8
    (one, grad_one), (eight, grad_eight) = results
    np.testing.assert_allclose(float(eight), float(one), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad_eight), jax.tree.leaves(grad_one), strict=True):
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale)


def test_iga_needs_the_pass_at_other_parameters():
    _, variables = init()
    data = batch(0)
    with pytest.raises(ValueError, match="Step.forward_at"):
        objectives.objective_loss(
            "iga", {}, None, jnp.asarray(data["image"]), jnp.asarray(data["label"]),
            num_domains=M, state={}, step=jnp.int32(0), key=None, advance=True,
            params=variables["params"])


@pytest.mark.slow
def test_iga_trains_on_rotated_digits(tmp_path):
    """IGA end to end: the second-order gradient through the CNN (SAM's composition is
    checked step by step above); two training domains, as its cost grows with each."""
    config = digits_config(objective="iga", algorithm="erm", steps=2, eval_every=1,
                           iga_penalty=10.0, test_envs=(0, 1, 2, 3))
    records = train.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    for key in ("loss", "penalty"):
        assert all(np.isfinite(r[key]) and r[key] > 0 for r in records), key


# ---------------------------------------------------------------- the sweep's draw


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


def test_sweep_draws_domainbeds_penalty():
    """DomainBed's ``hparams_registry``: ``_hparam('penalty', 1000, lambda r: 10**r.uniform(1,
    5))``, drawn from its own ``RandomState(seed_hash(seed_hash(h, t), 'penalty'))``."""
    for dataset, h, t in itertools.product(("PACS", "RotatedDigits"), (0, 1, 5, 17), (0, 2)):
        got = random_hparams("erm", dataset, h, t, objective="iga")["iga_penalty"]
        want = 1000 if h == 0 else 10 ** np.random.RandomState(
            db_seed_hash(db_seed_hash(h, t), "penalty")).uniform(1, 5)
        assert got == want, (dataset, h, t)
