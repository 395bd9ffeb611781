"""SagNet (sagm_jax.methods.style) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` ``SagNet.update``, written here in JAX x64: its own
``randomize`` (unbiased variance, eps 1e-5, the content swap detached), its own torch
Adam, and the reference's ``.grad`` buffers accumulated and zeroed literally in the
reference's order (``zero_grad``, ``backward``, ``step``), so which gradients each step
uses is re-derived here, not assumed. The random draws are computed here from the key
derivation ``sagm_jax.methods.style`` documents. Whole train steps run through
``make_train_step`` on a tiny dense featurizer and linear classifier; one tiny
end-to-end run trains SagNet on RotatedDigits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sagm_jax import methods
from sagm_jax.methods import networks, procedures
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

from float64_reference import adam_init, f64, ref_ce, torch_adam

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 2, 3, 2, 5, 4
M, B = 2, 3  # domains, rows per domain
N = M * B
LR, WD, W_ADV = 0.01, 0.1, 0.7
KEY = 7
TOL = dict(rtol=2e-4, atol=2e-6)
# Small features: their variance is of the order of randomize's eps 1e-5, so the unbiased
# variance and the eps change the restyled features (at unit scale both cancel out).
FEATURE_SCALE = 0.005


class TinyNet(nn.Module):
    """features = FEATURE_SCALE tanh(flatten(x) @ body + b), logits = features @ classifier + c."""

    @nn.compact
    def __call__(self, x, train: bool, mixstyle: bool = False, features: bool = False):
        h = FEATURE_SCALE * jnp.tanh(nn.Dense(DIM, name="body")(x.reshape(x.shape[0], -1)))
        logits = nn.Dense(CLASSES, name="classifier")(h)
        return (h, logits) if features else logits


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(N, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, N).astype(np.int32)}


def run_steps(steps=2):
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    rule = methods.update_rule("sagnet")
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    own = rule.network.init(jax.random.key(1), shapes, {"sag_w_adv": W_ADV})
    variables = networks.with_method_variables(dict(variables), own)
    proc = procedures.make_procedure("sagnet", {"sag_w_adv": W_ADV}, learning_rate=LR,
                                     weight_decay=WD, num_domains=M)
    step = jax.jit(make_train_step(net, proc, algorithm="sagnet", method=StepMethod("erm", {}, M)))
    state = create_train_state(variables, proc, {})
    states, metrics = [state], []
    for t in range(steps):
        state, m = step(state, batch(t), jax.random.key(KEY))
        states.append(state)
        metrics.append(m)
    return variables, states, metrics


def draws(t, which):
    """Pass ``which``'s (alpha [N, 1], permutation [N]) at step t, from the documented
    derivation: the train step's objective key, the third of split(fold_in(key, t), 3),
    then split(fold_in(., which)) = (dropout, draws), split(draws) = (alpha, permutation)."""
    objective_key = jax.random.split(jax.random.fold_in(jax.random.key(KEY), t), 3)[2]
    _, draw_key = jax.random.split(jax.random.fold_in(objective_key, which))
    alpha_key, perm_key = jax.random.split(draw_key)
    return (np.asarray(jax.random.uniform(alpha_key, (N, 1), jnp.float32), np.float64),
            np.asarray(jax.random.permutation(perm_key, N)))


def adam_count(state):
    found = [s.count for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1
    return int(found[0])


# ---------------------------------------------------------------- float64 re-statement




def ref_features(body, x):
    return FEATURE_SCALE * jnp.tanh(x.reshape(len(x), -1) @ body["kernel"] + body["bias"])


def ref_linear(head, h):
    return h @ head["kernel"] + head["bias"]


def ref_randomize(x, alpha, perm, what):
    """DomainBed's ``randomize`` on [N, d]: torch's unbiased ``var`` over d, eps 1e-5."""
    mean = x.mean(1, keepdims=True)
    var = ((x - mean) ** 2).sum(1, keepdims=True) / (x.shape[1] - 1)
    z = (x - mean) / jnp.sqrt(var + 1e-5)
    if what == "style":
        mean = alpha * mean + (1 - alpha) * mean[perm]
        var = alpha * var + (1 - alpha) * var[perm]
    else:
        z = jax.lax.stop_gradient(z[perm])  # x[idx_swap].detach()
    return z * jnp.sqrt(var + 1e-5) + mean








def zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def add(a, b):
    return jax.tree.map(jnp.add, a, b)


def ref_update(net, adams, grads, x, y, t):
    """DomainBed's ``SagNet.update`` with the three .grad buffers ``grads`` (f, c, s)
    carried between steps as torch keeps them."""
    f, c, s = net
    (alpha_c, perm_c), (alpha_s, perm_s), (alpha_a, perm_a) = (draws(t, p) for p in range(3))

    def loss_c_fn(f, c):  # forward_c
        return ref_ce(ref_linear(c, ref_randomize(ref_features(f, x), alpha_c, perm_c, "style")),
                      y).mean()

    def loss_s_fn(f, s):  # forward_s
        return ref_ce(ref_linear(s, ref_randomize(ref_features(f, x), alpha_s, perm_s,
                                                  "content")), y).mean()

    def loss_adv_fn(f, s):
        logits = ref_linear(s, ref_randomize(ref_features(f, x), alpha_a, perm_a, "content"))
        return -jax.nn.log_softmax(logits, axis=1).mean(1).mean() * W_ADV

    grads["f"], grads["c"] = zeros(f), zeros(c)  # optimizer_f/c.zero_grad()
    loss_c, (gf, gc) = jax.value_and_grad(loss_c_fn, (0, 1))(f, c)
    grads["f"], grads["c"] = add(grads["f"], gf), add(grads["c"], gc)
    f, adams["f"] = torch_adam(f, grads["f"], adams["f"], LR, WD)
    c, adams["c"] = torch_adam(c, grads["c"], adams["c"], LR, WD)
    grads["s"] = zeros(s)  # optimizer_s.zero_grad()
    loss_s, (gf, gs) = jax.value_and_grad(loss_s_fn, (0, 1))(f, s)
    grads["f"], grads["s"] = add(grads["f"], gf), add(grads["s"], gs)
    s, adams["s"] = torch_adam(s, grads["s"], adams["s"], LR, WD)
    grads["f"] = zeros(f)  # optimizer_f.zero_grad()
    loss_adv, (gf, gs) = jax.value_and_grad(loss_adv_fn, (0, 1))(f, s)
    grads["f"], grads["s"] = add(grads["f"], gf), add(grads["s"], gs)
    f, adams["f"] = torch_adam(f, grads["f"], adams["f"], LR, WD)
    return (f, c, s), {"loss_c": loss_c, "loss_s": loss_s, "loss_adv": loss_adv}


# ---------------------------------------------------------------- tests


def test_sagnet_two_steps_match_domainbeds_update():
    """Featurizer, content and style parameters after 2 steps, the three Adam counts
    (f steps twice per update) and the three reported losses (loss = loss_c)."""
    variables, states, metrics = run_steps()
    with jax.enable_x64(True):
        params = f64(variables["params"])
        net = (params["body"], params["classifier"], params["method"]["style_classifier"])
        adams = {"f": adam_init(net[0]), "c": adam_init(net[1]), "s": adam_init(net[2])}
        grads = {}
        for t in range(2):
            data = batch(t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            net, reported = ref_update(net, adams, grads, x, y, t)
            got = states[t + 1].params
            for want, ours in zip(net, (got["body"], got["classifier"],
                                        got["method"]["style_classifier"])):
                for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
            for name, value in reported.items():
                np.testing.assert_allclose(float(metrics[t][name]), float(value), **TOL)
            assert float(metrics[t]["loss"]) == float(metrics[t]["loss_c"])
            opt = states[t + 1].opt_state
            assert [adam_count(opt[g]) for g in ("featurizer", "content", "style")] == [
                2 * (t + 1), t + 1, t + 1]
    assert set(states[-1].params) == {"body", "classifier", "method"}


def test_draws_differ_between_passes_and_steps():
    """Each randomize has its own alpha and permutation (the re-statement's draws are
    those the update used, checked above); here: they are not shared."""
    taken = [draws(t, p) for t in range(2) for p in range(3)]
    alphas = np.stack([a.ravel() for a, _ in taken])
    assert len({tuple(np.round(a, 6)) for a in alphas}) == len(taken)
    assert all(0.0 <= a.min() and a.max() < 1.0 for a in alphas)
    assert all(sorted(p) == list(range(N)) for _, p in taken)


def test_style_classifier_is_torch_linear_init():
    """s ~ U(-1/sqrt(d), 1/sqrt(d)) for kernel [d, C] and bias, from split(key)."""
    d, classes = 64, 7
    own = methods.update_rule("sagnet").network.init(
        jax.random.key(3), networks.Shapes((8, 8, 1), d, classes, 3), {"sag_w_adv": 0.1})
    head = own["params"]["style_classifier"]
    kernel_key, bias_key = jax.random.split(jax.random.key(3))
    bound = 1.0 / np.sqrt(d)
    np.testing.assert_array_equal(head["kernel"], jax.random.uniform(
        kernel_key, (d, classes), jnp.float32, -bound, bound))
    np.testing.assert_array_equal(head["bias"], jax.random.uniform(
        bias_key, (classes,), jnp.float32, -bound, bound))
