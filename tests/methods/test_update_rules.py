"""sagm_jax.methods.update_rules against an independent float64 NumPy implementation of the
update rules (docs/optimizers.md; the SAGM authors' ``Wang-pengfei/SAGM``,
``domainbed/optimizers/sagm.py``).

The reference below computes a small MLP's cross-entropy gradient by hand
(no autodiff) and applies those formulas and PyTorch's Adam with coupled
L2 decay literally; the JAX side runs the package's transforms under jit.
"""

import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sagm_jax
from sagm_jax.training.train import optimizer_from_config

# ----------------------------------------------------------------------------
# Independent float64 reference.


def ref_loss_and_grad(p, x, y):
    """Mean cross-entropy of a tanh MLP and its gradient, by hand."""
    hidden = np.tanh(x @ p["w1"] + p["b1"])
    logits = hidden @ p["w2"] + p["b2"]
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = -np.mean(np.log(probs[np.arange(n), y]))
    dlogits = probs.copy()
    dlogits[np.arange(n), y] -= 1.0
    dlogits /= n
    dhidden = (dlogits @ p["w2"].T) * (1.0 - hidden**2)
    grads = {
        "w1": x.T @ dhidden,
        "b1": dhidden.sum(0),
        "w2": hidden.T @ dlogits,
        "b2": dlogits.sum(0),
    }
    return loss, grads


def ref_norm(tree):
    return np.sqrt(sum(np.sum(v**2) for v in tree.values()))


def ref_direction(rule, p, x, y, rho, alpha, combine="mean", adaptive=False):
    """The spec's ``d`` for one step, on one batch, float64."""
    grad_at = lambda q: ref_loss_and_grad(q, x, y)[1]
    return ref_head_direction(rule, p, grad_at, rho, alpha, combine, adaptive)


def ref_head_direction(
    rule, p, grad_at, rho, alpha, combine="mean", adaptive=False, ascent=None, descent="clean"
):
    """``d`` of a rule whose gradient at any point is ``grad_at``; ``ascent`` (DISAM's
    g_DI) replaces ``g`` in ``e``, and in SAGM's ``d`` when ``descent="variance"``."""
    g = grad_at(p)
    if rule == "erm":
        return g
    a = g if ascent is None else ascent
    ascent_alpha = alpha if rule == "sagm" else 0.0
    if adaptive:
        scale = rho / (ref_norm({k: np.abs(p[k]) * a[k] for k in p}) + 1e-12) - ascent_alpha
        e = {k: scale * p[k] ** 2 * a[k] for k in p}
    else:
        scale = rho / (ref_norm(a) + 1e-12) - ascent_alpha
        e = {k: scale * a[k] for k in p}
    gp = grad_at({k: p[k] + e[k] for k in p})
    if rule == "sam":
        return gp
    if rule in ("sagm", "erm_sam"):
        weight = 0.5 if combine == "mean" else 1.0
        first = a if descent == "variance" else g
        return {k: weight * (first[k] + gp[k]) for k in p}
    # gsam: d = g_p - alpha * (g - <g, g_p> / ||g_p||^2 * g_p)
    inner = sum(np.sum(g[k] * gp[k]) for k in p)
    coef = inner / ref_norm(gp) ** 2
    return {k: gp[k] - alpha * (g[k] - coef * gp[k]) for k in p}


class RefAdam:
    """PyTorch ``Adam(lr, weight_decay)``: coupled L2, eps outside the square root."""

    def __init__(self, p, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
        self.lr, self.wd, self.b1, self.b2, self.eps = lr, wd, b1, b2, eps
        self.m = {k: np.zeros_like(v) for k, v in p.items()}
        self.v = {k: np.zeros_like(v) for k, v in p.items()}
        self.t = 0

    def step(self, p, d, lr=None):
        lr = self.lr if lr is None else lr
        self.t += 1
        new = {}
        for k in p:
            dk = d[k] + self.wd * p[k]
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * dk
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * dk**2
            m_hat = self.m[k] / (1 - self.b1**self.t)
            v_hat = self.v[k] / (1 - self.b2**self.t)
            new[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + self.eps)
        return new


# ----------------------------------------------------------------------------
# The same MLP in JAX, and shared fixtures.


def mlp_loss(p, x, y):
    hidden = jnp.tanh(x @ p["w1"] + p["b1"])
    logits = hidden @ p["w2"] + p["b2"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def make_problem(seed=0, n=16, steps=6):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(0, 0.7, (5, 7)),
        "b1": rng.normal(0, 0.1, 7),
        "w2": rng.normal(0, 0.7, (7, 3)),
        "b2": rng.normal(0, 0.1, 3),
    }
    batches = [(rng.normal(size=(n, 5)), rng.integers(0, 3, n)) for _ in range(steps)]
    return params, batches


def make_step(opt):
    @jax.jit
    def step(params, state, x, y):
        grad_fn = lambda p, i: jax.grad(mlp_loss)(p, x, y)
        updates, state = opt.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
        return optax.apply_updates(params, updates), state

    return step


def assert_trees_close(actual, expected, rtol, atol=0.0):
    for k in expected:
        np.testing.assert_allclose(
            np.asarray(actual[k]), expected[k], rtol=rtol, atol=atol, err_msg=f"leaf {k}"
        )


RULES = [
    ("erm", {}),
    ("sam", {}),
    ("sam", {"adaptive": True}),
    ("gsam", {"alpha": 0.3}),
    ("sagm", {"alpha": 1e-3}),
    ("sagm", {"alpha": 0.3}),  # ||g|| > rho / alpha: the ascent scale is negative
    ("sagm", {"alpha": 0.3, "combine": "sum"}),
    ("sagm", {"alpha": 0.2, "adaptive": True}),
    ("erm_sam", {}),
]


@pytest.mark.parametrize("rule,kwargs", RULES, ids=[f"{r}-{k}" for r, k in RULES])
def test_paper_optimizer_matches_float64_reference(rule, kwargs):
    params, batches = make_problem()
    lr, wd, rho = 1e-2, 1e-2, 0.05
    with jax.enable_x64(True):
        opt = sagm_jax.paper_optimizer(rule, learning_rate=lr, weight_decay=wd, rho=rho, **kwargs)
        step = make_step(opt)
        p_jax = jax.tree.map(jnp.asarray, params)
        state = opt.init(p_jax)
        ref_p, ref_adam = dict(params), RefAdam(params, lr, wd)
        for x, y in batches:
            p_jax, state = step(p_jax, state, x, y)
            d = ref_direction(
                rule,
                ref_p,
                x,
                y,
                rho,
                kwargs.get("alpha", 0.0),
                kwargs.get("combine", "mean"),
                kwargs.get("adaptive", False),
            )
            ref_p = ref_adam.step(ref_p, d)
            assert_trees_close(p_jax, ref_p, rtol=1e-9, atol=1e-12)
    moved = max(np.max(np.abs(ref_p[k] - params[k])) for k in params)
    assert moved > 1e-2  # the run is long enough for a wrong rule to show


def test_perturbation_is_what_makes_the_rules_differ():
    """Guards the reference test: the rules give distinguishable parameters."""
    params, batches = make_problem()
    finals = {}
    for rule, kwargs in [
        ("erm", {}),
        ("sam", {}),
        ("sagm", {"alpha": 0.3}),
        ("gsam", {"alpha": 0.3}),
    ]:
        p, adam = dict(params), RefAdam(params, 1e-2, 1e-2)
        for x, y in batches:
            p = adam.step(p, ref_direction(rule, p, x, y, 0.5, kwargs.get("alpha", 0.0)))
        finals[rule] = p
    rules = list(finals)
    for i, a in enumerate(rules):
        for b in rules[i + 1 :]:
            gap = max(np.max(np.abs(finals[a][k] - finals[b][k])) for k in params)
            assert gap > 1e-6, (a, b)


def test_chain_with_clipping_weight_decay_and_schedules_under_jit():
    params, batches = make_problem(seed=1)
    rho_schedule = optax.linear_schedule(0.1, 0.02, transition_steps=len(batches))
    lr_schedule = optax.exponential_decay(2e-2, transition_steps=1, decay_rate=0.8)
    clip, wd, alpha = 0.05, 1e-2, 0.2
    with jax.enable_x64(True):
        opt = optax.chain(
            sagm_jax.sagm(rho=rho_schedule, alpha=alpha),
            optax.clip_by_global_norm(clip),
            optax.add_decayed_weights(wd),
            optax.adam(lr_schedule),
        )
        step = make_step(opt)
        p_jax = jax.tree.map(jnp.asarray, params)
        state = opt.init(p_jax)
        ref_p, ref_adam = dict(params), RefAdam(params, None, wd)
        clipped_steps = 0
        for t, (x, y) in enumerate(batches):
            p_jax, state = step(p_jax, state, x, y)
            # The schedules are the user's; evaluate them on the int32 count the state keeps.
            count = jnp.asarray(t, jnp.int32)
            d = ref_direction("sagm", ref_p, x, y, float(rho_schedule(count)), alpha)
            norm = ref_norm(d)
            if norm > clip:
                clipped_steps += 1
                d = {k: v * clip / norm for k, v in d.items()}
            ref_p = ref_adam.step(ref_p, d, lr=float(lr_schedule(count)))
            # The schedules compute in float32 inside jit, hence a looser atol than elsewhere.
            assert_trees_close(p_jax, ref_p, rtol=1e-8, atol=1e-10)
    assert clipped_steps > 0


def test_state_survives_orbax_round_trip(tmp_path):
    params, batches = make_problem(seed=2)
    opt = sagm_jax.paper_optimizer(
        "gsam", learning_rate=1e-2, weight_decay=1e-3, rho=optax.linear_schedule(0.05, 0.01, 4)
    )
    step = make_step(opt)
    batches = [(jnp.asarray(x, jnp.float32), jnp.asarray(y)) for x, y in batches]
    p = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
    state = opt.init(p)
    for x, y in batches[:3]:
        p, state = step(p, state, x, y)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": p, "opt_state": state})
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p, "opt_state": state})
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
    p_a, s_a, p_b, s_b = p, state, restored["params"], restored["opt_state"]
    for x, y in batches[3:]:
        p_a, s_a = step(p_a, s_a, x, y)
        p_b, s_b = step(p_b, s_b, x, y)
    for a, b in zip(jax.tree.leaves((p_a, s_a)), jax.tree.leaves((p_b, s_b))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(s_b[0].count) == len(batches)


@pytest.mark.parametrize(
    "transform",
    [
        sagm_jax.sagm(),
        sagm_jax.sagm(adaptive=True),
        sagm_jax.sam(),
        sagm_jax.sam(adaptive=True),
        sagm_jax.gsam(alpha=0.5),
    ],
    ids=["sagm", "sagm-adaptive", "sam", "sam-adaptive", "gsam"],
)
def test_zero_gradient_gives_zero_direction_not_nan(transform):
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt = optax.chain(transform, optax.add_decayed_weights(1e-4), optax.adam(1e-3))
    state = opt.init(params)
    updates, _ = jax.jit(lambda s: opt.update(zeros, s, params, grad_fn=lambda p, i: zeros))(state)
    direction, _ = transform.update(
        zeros, transform.init(params), params, grad_fn=lambda p, i: zeros
    )
    for leaf in jax.tree.leaves((updates, direction)):
        assert np.all(np.isfinite(np.asarray(leaf)))
    for leaf in jax.tree.leaves(direction):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)


def test_sagm_with_alpha_zero_is_erm_plus_sam():
    params, ((x, y), *_) = make_problem(seed=3)
    params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
    grad_fn = lambda p, i: jax.grad(mlp_loss)(p, x, y)
    g = grad_fn(params, 0)
    run = lambda t: t.update(g, t.init(params), params, grad_fn=grad_fn)[0]
    d_sagm, d_sam = run(sagm_jax.sagm(rho=0.3, alpha=0.0)), run(sagm_jax.sam(rho=0.3))
    for k in params:
        np.testing.assert_allclose(d_sagm[k], 0.5 * (g[k] + d_sam[k]), rtol=1e-6, atol=1e-7)
    d_alpha = run(sagm_jax.sagm(rho=0.3, alpha=0.3))
    assert max(float(jnp.max(jnp.abs(d_alpha[k] - d_sagm[k]))) for k in params) > 1e-4


def _sharded_step(opt, mesh):
    """One jitted update with the batch sharded over ``mesh`` and params replicated."""
    batch_sharding = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())
    step = make_step(opt)

    def run(params, x, y):
        params = jax.device_put(params, replicated)
        state = jax.device_put(opt.init(params), replicated)
        x, y = jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding)
        for _ in range(3):
            params, state = step(params, state, x, y)
        return params

    return run


@pytest.mark.parametrize("rule", ["sagm", "gsam", "sam"])
def test_global_mode_on_eight_devices_equals_one_device(rule):
    assert jax.device_count() == 8, "tests/conftest.py should fake 8 CPU devices"
    params, ((x, y), *_) = make_problem(seed=4, n=32)
    with jax.enable_x64(True):
        opt = sagm_jax.paper_optimizer(
            rule, learning_rate=1e-2, weight_decay=1e-3, rho=0.1, alpha=0.2
        )
        one = _sharded_step(opt, Mesh(np.array(jax.devices()[:1]), ("batch",)))(params, x, y)
        eight = _sharded_step(opt, Mesh(np.array(jax.devices()), ("batch",)))(params, x, y)
    assert_trees_close(eight, {k: np.asarray(v) for k, v in one.items()}, rtol=1e-12, atol=1e-14)


def _shard_mapped_direction(transform, mesh, params, x, y):
    def local(params, x, y):
        grad_fn = lambda p, i: jax.grad(mlp_loss)(p, x, y)
        return transform.update(
            grad_fn(params, 0), transform.init(params), params, grad_fn=grad_fn
        )[0]

    # check_vma=False: each device's grad_fn returns its own shard's gradient, as
    # under pmap (with check_vma=True, JAX would psum gradients of replicated params).
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P(), check_vma=False
    )
    return jax.jit(mapped)(params, x, y)


def test_global_mode_inside_shard_map_equals_one_device_reference():
    params, ((x, y), *_) = make_problem(seed=5, n=32)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    with jax.enable_x64(True):
        direction = _shard_mapped_direction(
            sagm_jax.sagm(rho=0.1, alpha=0.2, axis_name="batch"), mesh, params, x, y
        )
    expected = ref_direction("sagm", params, x, y, 0.1, 0.2)
    assert_trees_close(direction, expected, rtol=1e-10, atol=1e-14)


def test_per_device_mode_is_m_sharpness():
    """Each device perturbs with its own shard; the directions are averaged."""
    params, ((x, y), *_) = make_problem(seed=6, n=32)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    with jax.enable_x64(True):
        direction = _shard_mapped_direction(
            sagm_jax.sagm(rho=0.1, alpha=0.2, perturbation="per_device", axis_name="batch"),
            mesh,
            params,
            x,
            y,
        )
    shards = [
        ref_direction("sagm", params, xs, ys, 0.1, 0.2)
        for xs, ys in zip(np.split(x, 8), np.split(y, 8))
    ]
    expected = {k: np.mean([s[k] for s in shards], axis=0) for k in params}
    assert_trees_close(direction, expected, rtol=1e-10, atol=1e-14)
    global_direction = ref_direction("sagm", params, x, y, 0.1, 0.2)
    assert max(np.max(np.abs(expected[k] - global_direction[k])) for k in params) > 1e-6


def test_gsam_rho_schedule_follows_learning_rate():
    lr = optax.linear_schedule(1e-3, 1e-4, transition_steps=10)
    rho = sagm_jax.gsam_rho_schedule(lr, rho_max=0.1, rho_min=0.02, lr_max=1e-3, lr_min=1e-4)
    for t in [0, 3, 10]:
        expected = 0.02 + 0.08 * (float(lr(t)) - 1e-4) / (1e-3 - 1e-4)
        np.testing.assert_allclose(float(rho(t)), expected, rtol=1e-6)
    np.testing.assert_allclose(float(rho(0)), 0.1, rtol=1e-6)
    np.testing.assert_allclose(float(rho(10)), 0.02, rtol=1e-5)
    constant = sagm_jax.gsam_rho_schedule(optax.constant_schedule(1e-3), 0.05, 0.0, 1e-3, 1e-3)
    assert float(constant(7)) == pytest.approx(0.05)


def test_rho_schedule_reads_the_count_in_the_state():
    params, ((x, y), *_) = make_problem(seed=7)
    params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
    grad_fn = lambda p, i: jax.grad(mlp_loss)(p, x, y)
    scheduled = sagm_jax.gsam(rho=lambda t: 0.01 * (t + 1), alpha=0.2)
    state = scheduled.init(params)
    for t in range(3):
        direction, state = scheduled.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
        fixed = sagm_jax.gsam(rho=0.01 * (t + 1), alpha=0.2)
        expected, _ = fixed.update(grad_fn(params, 0), fixed.init(params), params, grad_fn=grad_fn)
        for k in params:
            np.testing.assert_allclose(direction[k], expected[k], rtol=1e-6)
    assert int(state.count) == 3


def test_erm_chain_accepts_and_ignores_grad_fn():
    def grad_fn(p, i):
        raise AssertionError("ERM must not compute a second gradient")

    opt = sagm_jax.paper_optimizer("erm", learning_rate=1e-3, weight_decay=0.0)
    params = {"w": jnp.ones(3)}
    updates, _ = opt.update({"w": jnp.ones(3)}, opt.init(params), params, grad_fn=grad_fn)
    np.testing.assert_allclose(updates["w"], -1e-3 * np.ones(3), rtol=1e-4)
    # DISAM's ascent gradient passes through optax.chain to every member; Adam ignores it.
    with_ascent, _ = opt.update(
        {"w": jnp.ones(3)}, opt.init(params), params, grad_fn=grad_fn,
        ascent_grads={"w": jnp.full(3, 7.0)},
    )
    np.testing.assert_array_equal(with_ascent["w"], updates["w"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="combine='avg'"):
        sagm_jax.sagm(combine="avg")
    with pytest.raises(ValueError, match="disam_descent='noisy'"):
        sagm_jax.sagm(disam_descent="noisy")
    with pytest.raises(ValueError, match="axis_name"):
        sagm_jax.sam(perturbation="per_device")
    with pytest.raises(ValueError, match="perturbation='local'"):
        sagm_jax.gsam(perturbation="local")
    with pytest.raises(ValueError, match="unknown update rule 'adam'; choose one of erm, sam"):
        sagm_jax.paper_optimizer("adam", learning_rate=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="'fish' is a procedure"):
        sagm_jax.paper_optimizer("fish", learning_rate=1e-3, weight_decay=0.0)
    transform, params = sagm_jax.sagm(), {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="grad_fn"):
        transform.update(params, transform.init(params), params)
    with pytest.raises(ValueError, match="params"):
        transform.update(params, transform.init(params), grad_fn=lambda p, i: p)


def test_global_norm_is_the_norm_of_leaf_norms():
    tree = {"a": np.arange(6.0).reshape(2, 3), "b": -np.ones(4)}
    expected = np.sqrt(np.sum(np.arange(6.0) ** 2) + 4.0)
    np.testing.assert_allclose(float(sagm_jax.global_norm(tree)), expected, rtol=1e-6)


# ----------------------------------------------------------------------------
# The optimizer built from a config (sagm_jax.training.train, where the program is set up):
# each algorithm gets its own alpha.

# GSAM's alpha for ResNets in Zhuang et al., ICLR 2022 (their hyperparameter table),
# written here independently of the package's constant.
GSAM_PAPER_ALPHA = 0.01


def _run_config_optimizer(config, params, batches):
    """Parameters after the batches, under the optimizer built from ``config``."""
    opt = optimizer_from_config(config)
    step = make_step(opt)
    p = jax.tree.map(jnp.asarray, params)
    state = opt.init(p)
    for x, y in batches:
        p, state = step(p, state, x, y)
    return p


def _reference_run(rule, params, batches, lr, wd, rho, alpha):
    ref_p, ref_adam = dict(params), RefAdam(params, lr, wd)
    for x, y in batches:
        ref_p = ref_adam.step(ref_p, ref_direction(rule, ref_p, x, y, rho, alpha))
    return ref_p


@pytest.mark.parametrize("algorithm", ["gsam", "sagm", "erm_sam"])
def test_paper_config_gives_each_algorithm_its_own_alpha(algorithm):
    """configs/pacs.py with algorithm=gsam runs GSAM with GSAM's paper alpha, not
    SAGM's 1e-3 (with which GSAM is nearly SAM); SAGM keeps config.alpha."""
    config = runpy.run_path(
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs", "pacs.py")
    )["get_config"]()
    config.algorithm = algorithm
    config.lr = 1e-2  # the paper's 3e-5 moves the MLP too little to tell the rules apart
    expected_alpha = {"gsam": GSAM_PAPER_ALPHA, "sagm": 1e-3, "erm_sam": 0.0}[algorithm]
    params, batches = make_problem(seed=1)
    with jax.enable_x64(True):
        actual = _run_config_optimizer(config, params, batches)
    wd, rho = config.weight_decay, config.rho
    ref = _reference_run(algorithm, params, batches, config.lr, wd, rho, expected_alpha)
    delta = {k: np.asarray(actual[k]) - params[k] for k in params}
    assert_trees_close(delta, {k: ref[k] - params[k] for k in params}, rtol=1e-7, atol=1e-12)
    if algorithm == "gsam":  # the test tells GSAM's alpha from SAGM's
        other = _reference_run("gsam", params, batches, config.lr, wd, rho, config.alpha)
        gap = max(np.max(np.abs(other[k] - ref[k])) for k in params)
        worst = max(np.max(np.abs(delta[k] - (ref[k] - params[k]))) for k in params)
        assert gap > 1e4 * worst


def test_gsams_default_alpha_is_its_papers():
    assert sagm_jax.methods.update_rules.GSAM_ALPHA == GSAM_PAPER_ALPHA


# ----------------------------------------------------------------------------
# DISAM (docs/methods.md, "DISAM"): the heads' ascent step from
# g_DI = grad(L_bar - lambda V), restated by hand from the per-domain gradients.

DISAM_LAMBDA = 0.5


def make_domains(seed, b=8, steps=1):
    """Per step, three domain minibatches stacked as x (3, b, 5), y (3, b); each domain's
    inputs are shifted and scaled differently, so their losses differ."""
    rng = np.random.default_rng(seed)
    shifts_scales = [(0.0, 1.0), (0.8, 0.5), (-0.5, 2.0)]
    return [
        (
            np.stack([rng.normal(shift, scale, (b, 5)) for shift, scale in shifts_scales]),
            rng.integers(0, 3, (len(shifts_scales), b)),
        )
        for _ in range(steps)
    ]


def ref_mean_domain_grad_at(x, y):
    """The gradient of ``L_bar``, the mean of the domains' losses, at any point."""

    def grad_at(p):
        grads = [ref_loss_and_grad(p, xk, yk)[1] for xk, yk in zip(x, y)]
        return {k: np.mean([gk[k] for gk in grads], axis=0) for k in p}

    return grad_at


def ref_disam_ascent_grad(p, x, y, lam):
    """``g_DI = sum_k (1/M - (2 lam / M)(L_k - L_bar)) grad L_k`` (DISAM's Eq. 8)."""
    results = [ref_loss_and_grad(p, xk, yk) for xk, yk in zip(x, y)]
    losses = np.array([loss for loss, _ in results])
    m = len(losses)
    weights = 1.0 / m - (2.0 * lam / m) * (losses - losses.mean())
    return {k: sum(w * gk[k] for w, (_, gk) in zip(weights, results)) for k in p}


def ref_disam_direction(rule, p, x, y, rho, alpha, lam, descent="clean", adaptive=False):
    grad_at = ref_mean_domain_grad_at(x, y)
    ascent = ref_disam_ascent_grad(p, x, y, lam)
    return ref_head_direction(
        rule, p, grad_at, rho, alpha, adaptive=adaptive, ascent=ascent, descent=descent
    )


def domain_losses(p, x, y):
    return jax.vmap(mlp_loss, in_axes=(None, 0, 0))(p, x, y)


def mean_domain_grad_fn(x, y):
    return lambda p, i: jax.grad(lambda q: jnp.mean(domain_losses(q, x, y)))(p)


def disam_gradients(params, x, y, lam, axis_name=None):
    """``g`` and ``g_DI`` from one forward (two vjps), as a train step computes them;
    with ``axis_name`` the cotangents use the global (``pmean``-ed) domain losses."""
    losses, vjp = jax.vjp(lambda p: domain_losses(p, x, y), params)
    global_losses = losses if axis_name is None else jax.lax.pmean(losses, axis_name)
    (g,) = vjp(jnp.full_like(losses, 1.0 / losses.size))
    (g_di,) = vjp(jax.grad(sagm_jax.methods.update_rules.disam_ascent_objective)(global_losses, lam))
    return g, g_di


def make_disam_step(opt, lam):
    @jax.jit
    def step(params, state, x, y):
        g, g_di = disam_gradients(params, x, y, lam)
        updates, state = opt.update(
            g, state, params, grad_fn=mean_domain_grad_fn(x, y), ascent_grads=g_di
        )
        return optax.apply_updates(params, updates), state

    return step


def disam_head(rule, rho, alpha=0.0, descent="clean", adaptive=False, **kwargs):
    if rule == "sam":
        return sagm_jax.sam(rho, adaptive=adaptive, **kwargs)
    if rule == "gsam":
        return sagm_jax.gsam(rho, alpha, adaptive=adaptive, **kwargs)
    return sagm_jax.sagm(rho, alpha, disam_descent=descent, adaptive=adaptive, **kwargs)


def head_direction(transform, params, x, y, lam):
    """The head's ``d`` under jit, with ``ascent_grads = g_DI``."""

    @jax.jit
    def run(params):
        g, g_di = disam_gradients(params, x, y, lam)
        grad_fn, state = mean_domain_grad_fn(x, y), transform.init(params)
        return transform.update(g, state, params, grad_fn=grad_fn, ascent_grads=g_di)[0]

    return run(params)


def max_gap(a, b):
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in b)


DISAM_RULES = [
    ("sam", 0.0, "clean", False),
    ("sam", 0.0, "clean", True),
    ("gsam", 0.3, "clean", False),
    ("sagm", 0.3, "clean", False),
    ("sagm", 0.3, "variance", False),
    ("sagm", 0.2, "clean", True),
]


@pytest.mark.parametrize(
    "rule,alpha,descent,adaptive",
    DISAM_RULES,
    ids=[f"{r}-{d}" + ("-adaptive" if a else "") for r, _, d, a in DISAM_RULES],
)
def test_disam_direction_matches_float64_reference(rule, alpha, descent, adaptive):
    params, _ = make_problem(seed=8)
    ((x, y),) = make_domains(seed=9)
    rho = 0.1
    with jax.enable_x64(True):
        transform = disam_head(rule, rho, alpha, descent, adaptive)
        actual = head_direction(transform, jax.tree.map(jnp.asarray, params), x, y, DISAM_LAMBDA)
    expected = ref_disam_direction(rule, params, x, y, rho, alpha, DISAM_LAMBDA, descent, adaptive)
    assert_trees_close(actual, expected, rtol=1e-10, atol=1e-14)
    # Guard: DISAM's ascent changes the direction well beyond the tolerance.
    plain = ref_disam_direction(rule, params, x, y, rho, alpha, 0.0, descent, adaptive)
    assert max_gap(expected, plain) > 1e-4
    if descent == "variance":
        clean = ref_disam_direction(rule, params, x, y, rho, alpha, DISAM_LAMBDA, "clean")
        assert max_gap(expected, clean) > 1e-3


@pytest.mark.parametrize(
    "rule,descent", [("sagm", "clean"), ("sagm", "variance"), ("gsam", "variance")]
)
def test_disam_paper_optimizer_matches_float64_reference(rule, descent):
    """Several steps of the whole optimizer; ``disam_descent`` reaches SAGM and changes
    nothing for GSAM (the reference has one DISAM-GSAM rule)."""
    params, _ = make_problem(seed=10)
    batches = make_domains(seed=11, steps=4)
    lr, wd, rho, alpha = 1e-2, 1e-2, 0.1, 0.3
    with jax.enable_x64(True):
        opt = sagm_jax.paper_optimizer(
            rule, learning_rate=lr, weight_decay=wd, rho=rho, alpha=alpha, disam_descent=descent
        )
        step = make_disam_step(opt, DISAM_LAMBDA)
        p_jax = jax.tree.map(jnp.asarray, params)
        state = opt.init(p_jax)
        ref_p, ref_adam = dict(params), RefAdam(params, lr, wd)
        for x, y in batches:
            p_jax, state = step(p_jax, state, x, y)
            d = ref_disam_direction(rule, ref_p, x, y, rho, alpha, DISAM_LAMBDA, descent)
            ref_p = ref_adam.step(ref_p, d)
            assert_trees_close(p_jax, ref_p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("lam", [0.5, 2.0])
def test_disam_ascent_objective_and_its_gradient_are_eq_8(lam):
    params, _ = make_problem(seed=12)
    ((x, y),) = make_domains(seed=13)
    objective = sagm_jax.methods.update_rules.disam_ascent_objective
    with jax.enable_x64(True):
        p = jax.tree.map(jnp.asarray, params)
        value, grads = jax.jit(
            jax.value_and_grad(lambda q: objective(domain_losses(q, x, y), lam))
        )(p)
    losses = np.array([ref_loss_and_grad(params, xk, yk)[0] for xk, yk in zip(x, y)])
    variance = np.sum((losses - losses.mean()) ** 2) / len(losses)
    np.testing.assert_allclose(float(value), losses.mean() - lam * variance, rtol=1e-12)
    assert variance > 1e-2  # the domains' losses differ, so lam matters
    assert_trees_close(grads, ref_disam_ascent_grad(params, x, y, lam), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("rule", ["sam", "sagm"])
def test_disam_with_lambda_zero_is_plain_sam_and_sagm_exactly(rule):
    params, _ = make_problem(seed=14)
    ((x, y),) = make_domains(seed=15)
    transform = disam_head(rule, 0.1, 0.3, "variance")

    @jax.jit
    def run(p):
        g, g_di = disam_gradients(p, x, y, 0.0)
        grad_fn, state = mean_domain_grad_fn(x, y), transform.init(p)
        with_disam = transform.update(g, state, p, grad_fn=grad_fn, ascent_grads=g_di)[0]
        return g, g_di, with_disam, transform.update(g, state, p, grad_fn=grad_fn)[0]

    with jax.enable_x64(True):
        g, g_di, with_disam, plain = run(jax.tree.map(jnp.asarray, params))
    for k in params:
        np.testing.assert_array_equal(np.asarray(g_di[k]), np.asarray(g[k]))
        np.testing.assert_array_equal(np.asarray(with_disam[k]), np.asarray(plain[k]))


def test_disam_global_mode_on_eight_devices_equals_one_device():
    """Under jit with each domain's minibatch sharded (the rules' own 8-device tests
    are above; what DISAM adds is the same for every head)."""
    assert jax.device_count() == 8, "tests/conftest.py should fake 8 CPU devices"
    params, _ = make_problem(seed=16)
    ((x, y),) = make_domains(seed=17, b=16)

    def run(mesh):
        # Each domain's minibatch is split over the devices.
        batch_sharding = NamedSharding(mesh, P(None, "batch"))
        p = jax.device_put(jax.tree.map(jnp.asarray, params), NamedSharding(mesh, P()))
        state = jax.device_put(opt.init(p), NamedSharding(mesh, P()))
        xs, ys = jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding)
        for _ in range(3):
            p, state = step(p, state, xs, ys)
        return p

    with jax.enable_x64(True):
        opt = sagm_jax.paper_optimizer(
            "sagm", learning_rate=1e-2, weight_decay=1e-3, rho=0.1, alpha=0.2,
            disam_descent="variance",
        )
        step = make_disam_step(opt, DISAM_LAMBDA)
        one = run(Mesh(np.array(jax.devices()[:1]), ("batch",)))
        eight = run(Mesh(np.array(jax.devices()), ("batch",)))
    assert_trees_close(eight, {k: np.asarray(v) for k, v in one.items()}, rtol=1e-12, atol=1e-14)


def test_disam_inside_shard_map_pmeans_ascent_grads_like_one_device():
    """Global mode with ``axis_name``: each device passes its shard's g and g_DI (from
    the global domain losses' cotangents); the head averages both."""
    params, _ = make_problem(seed=18)
    ((x, y),) = make_domains(seed=19, b=16)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rho, alpha = 0.1, 0.2

    def direction(global_losses_in_cotangents):
        def local(params, x, y):
            axis = "batch" if global_losses_in_cotangents else None
            g, g_di = disam_gradients(params, x, y, DISAM_LAMBDA, axis_name=axis)
            head = sagm_jax.sagm(rho, alpha, axis_name="batch")
            return head.update(
                g, head.init(params), params, grad_fn=mean_domain_grad_fn(x, y), ascent_grads=g_di
            )[0]

        spec = P(None, "batch")
        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), spec, spec), out_specs=P(), check_vma=False
        )
        return jax.jit(mapped)(jax.tree.map(jnp.asarray, params), x, y)

    with jax.enable_x64(True):
        actual, per_shard_cotangents = direction(True), direction(False)
    expected = ref_disam_direction("sagm", params, x, y, rho, alpha, DISAM_LAMBDA)
    assert_trees_close(actual, expected, rtol=1e-10, atol=1e-14)
    # Why the losses are pmean-ed first: shard losses give another, wrong g_DI.
    assert max_gap(per_shard_cotangents, expected) > 1e-6


@pytest.mark.parametrize("transform", [sagm_jax.sagm, sagm_jax.sam, sagm_jax.gsam])
@pytest.mark.parametrize("rho", [-1.0, float("nan"), float("inf"), -1])
def test_a_negative_or_non_finite_rho_is_refused_at_construction(transform, rho):
    with pytest.raises(ValueError, match=r"^rho=.*: expected a finite number >= 0"):
        transform(rho=rho)
    transform(rho=0.0)  # a head with rho 0 is the config's to refuse, not the transform's
    transform(rho=optax.constant_schedule(0.05))


@pytest.mark.parametrize(
    "build,argument,expected",
    [
        (lambda: sagm_jax.sagm(alpha=2.0), "sagm(alpha=2.0)", "a number in [0, 1)"),
        (lambda: sagm_jax.sagm(alpha=-1), "sagm(alpha=-1)", "a number in [0, 1)"),
        (lambda: sagm_jax.sagm(alpha=1.0), "sagm(alpha=1.0)", "a number in [0, 1)"),
        (lambda: sagm_jax.gsam(alpha=1.5), "gsam(alpha=1.5)", "a number in [0, 1]"),
        (lambda: sagm_jax.gsam(alpha=-0.1), "gsam(alpha=-0.1)", "a number in [0, 1]"),
        (lambda: sagm_jax.sam(rho=11.0), "rho=11.0", "a finite number in [0, 10]"),
        (lambda: sagm_jax.sagm(combine="avg"), "combine='avg'", "'mean'"),
    ],
)
def test_the_transforms_refuse_what_the_config_refuses_where_they_are_built(
    build, argument, expected
):
    # The command line's bounds (docs/optimizers.md): SAGM's alpha in [0, 1), GSAM's in
    # [0, 1], rho at most 10.
    with pytest.raises(ValueError) as error:
        build()
    message = str(error.value)
    assert message.startswith(argument) and expected in message, message


def test_the_transforms_take_the_bounds_edges_and_traced_values():
    sagm_jax.sagm(alpha=0.0), sagm_jax.sagm(alpha=0.999), sagm_jax.sagm(rho=10.0)
    sagm_jax.gsam(alpha=0.0), sagm_jax.gsam(alpha=1.0)
    # Inside jit (a pack's traced hyperparameters) there is no value to check.
    jax.jit(lambda a: sagm_jax.sagm(alpha=a).init(jnp.zeros(2)).count)(jnp.float32(2.0))
