"""ARM and MTL (sagm_jax.methods.adaptive) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` (``ARM``, ``MTL``) and ``domainbed/networks.py``
(``ContextNet``), written here in JAX x64 with its own convolution (a sum over kernel
offsets), torch's BatchNorm2d, the reference's reshape-and-repeat support grouping and
torch's Adam; the package's code is never the reference. The network is a tiny dense
featurizer and classifier (``TinyNet``); whole train steps run through
``make_train_step``. One tiny end-to-end run of each checks that the recorded accuracies
are the method's prediction, and DomainBed's 4-channel stem is checked on synthetic
torchvision weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagm_jax import methods
from sagm_jax.methods import networks
from sagm_jax.methods.update_rules import rule_optimizer
from sagm_jax.training import train_step as train_step_lib
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

from float64_reference import TanhNet, adam_init, f64, ref_ce, tanh_net, torch_adam

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 4, 5, 2, 3, 4
M, B = 2, 3  # domains, rows per domain (the support size)
LR = 0.01
TOL = dict(rtol=2e-4, atol=2e-6)


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def build(objective, hp, channels):
    """The method's model (MethodModel over TinyNet) and its variables."""
    entry = methods.objective(objective)
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, channels)), train=False)
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    own = entry.network.init(jax.random.key(1), shapes, hp)
    variables = networks.with_method_variables(dict(variables), own)
    return networks.MethodModel(net, entry.network, hp), variables


def run_steps(objective, hp, channels, algorithm="erm", wd=0.0, steps=2, rule_hp=None):
    model, variables = build(objective, hp, channels)
    # As training builds it: a method's frozen parameters are left out of the decay.
    mask = networks.decay_mask(methods.OBJECTIVES[objective].network, hp)
    opt = rule_optimizer(algorithm, rule_hp or {}, learning_rate=LR, weight_decay=wd,
                         decay_mask=mask)
    method = StepMethod(objective, hp, M)
    step = jax.jit(make_train_step(model, opt, algorithm=algorithm, method=method))
    state = create_train_state(variables, opt, {})
    states, metrics = [state], []
    for t in range(steps):
        state, m = step(state, batch(M * B, seed=t), jax.random.key(7))
        states.append(state)
        metrics.append(m)
    return variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement




ref_tiny = tanh_net


def ref_conv(x, layer):
    """torch's Conv2d(k=5, padding=2): sum over the 25 kernel offsets of the zero-padded
    input's shifted window times that offset's [in, out] matrix, plus the bias."""
    k = layer["kernel"].shape[0]
    xp = jnp.pad(x, ((0, 0), (k // 2, k // 2), (k // 2, k // 2), (0, 0)))
    h, w = x.shape[1], x.shape[2]
    out = sum(jnp.einsum("nhwc,co->nhwo", xp[:, a:a + h, b:b + w, :], layer["kernel"][a, b])
              for a in range(k) for b in range(k))
    return out + layer["bias"]


def ref_batchnorm(x, layer, stats, train):
    if train:
        mean, var = x.mean((0, 1, 2)), ((x - x.mean((0, 1, 2))) ** 2).mean((0, 1, 2))
        n = x.shape[0] * x.shape[1] * x.shape[2]
        stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean,
                 "var": 0.9 * stats["var"] + 0.1 * var * n / (n - 1)}
    else:
        mean, var = stats["mean"], stats["var"]
    return (x - mean) / jnp.sqrt(var + 1e-5) * layer["scale"] + layer["bias"], stats


def ref_context(weights, stats, x, train):
    new = {}
    x = ref_conv(x, weights["conv1"])
    x, new["bn1"] = ref_batchnorm(x, weights["bn1"], stats["bn1"], train)
    x = ref_conv(jnp.maximum(x, 0), weights["conv2"])
    x, new["bn2"] = ref_batchnorm(x, weights["bn2"], stats["bn2"], train)
    return ref_conv(jnp.maximum(x, 0), weights["conv3"]), new


def ref_arm(net, weights, stats, x, support, train):
    """DomainBed's ``ARM.predict``: meta batches of ``support`` rows when it divides the
    batch, else one of the whole batch; the context mean repeated over each."""
    n = len(x)
    meta, size = (n // support, support) if n % support == 0 else (1, n)
    context, stats = ref_context(weights, stats, x, train)
    context = jnp.repeat(context.reshape(meta, size, *context.shape[1:]).mean(1), size, 0)
    return ref_tiny(net, jnp.concatenate([x, context], -1))[1], stats








def assert_close(got, want, **tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tol or TOL))


# ---------------------------------------------------------------- ARM


def arm_hp(context="untrained"):
    return {"arm_context": context, networks.BATCH_PER_ENV: B}


@pytest.mark.parametrize("context,wd", [("untrained", 0.1), ("trained", 0.1)])
def test_arm_two_adam_steps(context, wd):
    """Loss and every parameter after 2 steps: the network on [x, domain-mean context]
    (the training batch's groups are its domains), the context network's BatchNorm
    statistics updated in training mode, its weights constant (DomainBed's optimizer
    omits them: no gradient and no weight decay) or trained."""
    variables, states, metrics = run_steps("arm", arm_hp(context), CHANNELS + 1, wd=wd)
    with jax.enable_x64(True):
        net = f64({k: v for k, v in variables["params"].items() if k != "method"})
        weights = f64(variables["params"]["method"]["context"])
        stats = f64(variables["batch_stats"]["method"]["context"])
        trained = {"net": net, "context": weights}
        adam = adam_init(trained if context == "trained" else net)

        def loss(q, stats, x, y):
            logits, new = ref_arm(q["net"], q["context"], stats, x, B, train=True)
            return ref_ce(logits, y).mean(), new

        # Compiled once for both steps; untrained, the gradient of the network's alone.
        grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        for t in range(2):
            data = batch(M * B, seed=t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            (value, new_stats), g = grad_fn(trained, stats, x, y)
            if context == "trained":
                trained, adam = torch_adam(trained, g, adam, LR, wd)
            else:
                net, adam = torch_adam(trained["net"], g["net"], adam, LR, wd)
                trained = {"net": net, "context": trained["context"]}
            stats = new_stats
            np.testing.assert_allclose(float(metrics[t]["loss"]), float(value), **TOL)
            got = states[t + 1]
            assert_close({k: v for k, v in got.params.items() if k != "method"}, trained["net"])
            # Elements whose gradient is near Adam's eps take float32-sensitive steps.
            assert_close(got.params["method"]["context"], trained["context"],
                         rtol=2e-4, atol=LR * 1e-2)
            assert_close(got.batch_stats["method"]["context"], stats)
    if context == "untrained":  # exactly the initial weights
        for a, b in zip(jax.tree.leaves(states[-1].params["method"]),
                        jax.tree.leaves(variables["params"]["method"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rows,real", [(6, 6), (7, 7), (8, 6), (8, 7)])
def test_arm_prediction_groups_the_evaluated_batch(rows, real):
    """Evaluation (running statistics): groups of ``batch_per_env`` rows when it divides
    the batch's real rows, else one group of them all, as the reference predicts on the
    short batch of the real rows alone; padding rows (mask False) take no part."""
    model, variables = build("arm", arm_hp(), CHANNELS + 1)
    # running statistics that are not the initial ones
    variables["batch_stats"]["method"]["context"] = jax.tree.map(
        lambda s: s + 0.3, variables["batch_stats"]["method"]["context"])
    data = batch(rows, seed=5)
    mask = np.arange(rows) < real
    kwargs = {} if real == rows else {"mask": jnp.asarray(mask)}
    logits = model.apply(variables, jnp.asarray(data["image"]), train=False, **kwargs)
    with jax.enable_x64(True):
        expected, _ = ref_arm(
            f64({k: v for k, v in variables["params"].items() if k != "method"}),
            f64(variables["params"]["method"]["context"]),
            f64(variables["batch_stats"]["method"]["context"]),
            jnp.asarray(data["image"][:real], jnp.float64), B, train=False)
        np.testing.assert_allclose(np.asarray(logits)[:real], np.asarray(expected), **TOL)


# ---------------------------------------------------------------- MTL


def mtl_hp(embedding, ema=0.7):
    return {"mtl_ema": ema, "mtl_embedding": embedding, networks.BATCH_PER_ENV: B}


def ref_mtl(net, clf, stored, x, y, ema, noise):
    """DomainBed's ``MTL.update``: sum over domains of CE(classifier([phi_m, e_m]), y_m),
    e_m = ema mean(phi_m) + (1 - ema) E_m (through the mean), or the ``.normal_()`` draws;
    returns the loss and the new E."""
    features = ref_tiny(net, x)[0].reshape(M, B, DIM)
    current = ema * features.mean(1) + (1 - ema) * stored
    embedding = jnp.broadcast_to(current[:, None], features.shape) if noise is None else noise
    logits = jnp.concatenate([features, embedding], -1) @ clf["kernel"] + clf["bias"]
    losses = jnp.stack([ref_ce(logits[m], y.reshape(M, B)[m]).mean() for m in range(M)])
    return losses.sum(), jax.lax.stop_gradient(current)


def objective_noise(t):
    """The N(0, 1) draws of step t: the package's draw (the objective's key of that
    step, as the train step derives it), re-applied in the re-statement."""
    key = train_step_lib.step_keys(jax.random.key(7), t)[2]
    return jnp.asarray(np.asarray(jax.random.normal(key, (M, B, DIM), jnp.float32)), jnp.float64)


@pytest.mark.parametrize("embedding", ["mean", "noise"])
def test_mtl_two_adam_steps_and_embeddings(embedding):
    """Loss (the sum of the domain losses), the featurizer and MTL's own classifier after
    2 steps, and the EMA embeddings E; the network's own classifier gets no gradient."""
    wd, ema = 0.1, 0.7
    variables, states, metrics = run_steps("mtl", mtl_hp(embedding, ema), CHANNELS, wd=wd)
    with jax.enable_x64(True):
        trained = {"body": f64(variables["params"]["body"]),
                   "clf": f64(variables["params"]["method"]["classifier"])}
        classifier = f64(variables["params"]["classifier"])
        stored = jnp.zeros((M, DIM), jnp.float64)
        adam = adam_init(trained)
        for t in range(2):
            data = batch(M * B, seed=t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            noise = objective_noise(t) if embedding == "noise" else None

            def loss(q):
                net = {"body": q["body"], "classifier": classifier}
                return ref_mtl(net, q["clf"], stored, x, y, ema, noise)

            (value, stored), g = jax.value_and_grad(loss, has_aux=True)(trained)
            trained, adam = torch_adam(trained, g, adam, LR, wd)
            got = states[t + 1]
            np.testing.assert_allclose(float(metrics[t]["loss"]), float(value), **TOL)
            assert_close(got.params["body"], trained["body"])
            assert_close(got.params["method"]["classifier"], trained["clf"])
            assert_close(got.batch_stats["method"]["embeddings"], stored)


def test_mtl_embeddings_advance_once_per_sagm_step():
    """Under SAGM the perturbed pass leaves E alone: after each step E is the EMA of the
    clean pass's features at the step's starting weights."""
    ema = 0.5
    _, states, _ = run_steps("mtl", mtl_hp("mean", ema), CHANNELS, algorithm="sagm",
                             rule_hp={"rho": 0.5, "alpha": 0.01})
    with jax.enable_x64(True):
        stored = jnp.zeros((M, DIM), jnp.float64)
        for t in range(2):
            x = jnp.asarray(batch(M * B, seed=t)["image"], jnp.float64)
            features = ref_tiny(f64(states[t].params), x)[0].reshape(M, B, DIM)
            stored = ema * features.mean(1) + (1 - ema) * stored
            assert_close(states[t + 1].batch_stats["method"]["embeddings"], stored)


def test_objective_key_is_no_pass_key():
    """Over 50 steps, the objective's key (MTL's noise, Mixup's pairs) is none of the keys
    the two passes draw dropout and MixStyle from, nor any other step's key: a key shared
    with a pass would tie the noise to that pass's dropout."""
    seen = {}
    for t in range(50):
        clean, perturbed, objective = train_step_lib.step_keys(jax.random.key(7), t)
        named = {"clean": clean, "perturbed": perturbed, "objective": objective}
        for name in ("clean", "perturbed"):
            dropout, mixstyle = jax.random.split(named[name])
            named[f"{name} dropout"], named[f"{name} mixstyle"] = dropout, mixstyle
        for name, key in named.items():
            data = tuple(np.asarray(jax.random.key_data(key)).tolist())
            assert data not in seen, f"step {t}: the {name} key is the {seen.get(data)} key"
            seen[data] = f"step {t} {name}"


def test_mtl_training_noise_is_fresh_iid_normal_over_steps(monkeypatch):
    """MTL's training draws over 24 SAGM steps, as the train step makes them: the same in
    the clean and the perturbed pass of a step (one loss), independent across steps, rows
    and coordinates, and N(0, 1) (Kolmogorov-Smirnov), as the reference's fresh
    ``.normal_()`` of every call."""
    from scipy import stats

    from sagm_jax.methods import adaptive

    draws = []
    drawn = adaptive.embedding_noise

    def recorded(key, shape):
        z = drawn(key, shape)
        jax.debug.callback(lambda v: draws.append(np.asarray(v)), z)
        return z

    monkeypatch.setattr(adaptive, "embedding_noise", recorded)
    steps = 24
    run_steps("mtl", mtl_hp("noise"), CHANNELS, algorithm="sagm", steps=steps,
              rule_hp={"rho": 0.05, "alpha": 0.01})
    assert len(draws) == 2 * steps and draws[0].shape == (M, B, DIM)
    clean, perturbed = np.stack(draws[0::2]), np.stack(draws[1::2])
    np.testing.assert_array_equal(clean, perturbed)
    flat = clean.reshape(steps, -1)
    assert stats.kstest(flat.ravel(), "norm").pvalue > 1e-3
    corr = np.corrcoef(flat)[~np.eye(steps, dtype=bool)]
    # 18 draws per step: |r| of independent steps stays below 0.9 (p < 1e-6 each).
    assert np.abs(corr).max() < 0.9
    rows = clean.reshape(steps * M * B, DIM)
    assert len({r.tobytes() for r in rows}) == len(rows)


@pytest.mark.parametrize("embedding", ["mean", "noise"])
def test_mtl_prediction_from_the_evaluated_batch(embedding):
    """Evaluation (``env=None``): the embedding is the mean feature of the real rows (the
    reference's short batch), or the N(0, 1) draws of the fixed evaluation key."""
    model, variables = build("mtl", mtl_hp(embedding), CHANNELS)
    data = batch(8, seed=3)
    real = 6
    logits = model.apply(variables, jnp.asarray(data["image"]), train=False,
                         mask=jnp.arange(8) < real)
    with jax.enable_x64(True):
        net = f64({k: v for k, v in variables["params"].items() if k != "method"})
        clf = f64(variables["params"]["method"]["classifier"])
        features = ref_tiny(net, jnp.asarray(data["image"], jnp.float64))[0]
        if embedding == "mean":
            embedding_rows = jnp.broadcast_to(features[:real].mean(0), features.shape)
        else:
            from sagm_jax.methods.adaptive import EVAL_NOISE_SEED
            drawn = jax.random.normal(jax.random.PRNGKey(EVAL_NOISE_SEED), (8, DIM), jnp.float32)
            embedding_rows = jnp.asarray(np.asarray(drawn), jnp.float64)
        expected = jnp.concatenate([features, embedding_rows], -1) @ clf["kernel"] + clf["bias"]
        np.testing.assert_allclose(np.asarray(logits)[:real], np.asarray(expected)[:real], **TOL)


# ---------------------------------------------------------------- the pretrained stem


def test_pretrained_stem_copies_channel_i_from_i_mod_3():
    """DomainBed's ``ResNet`` for nc != 3 input channels: conv1's input channel i is the
    pretrained channel i % 3; every other entry is copied as it is."""
    from sagm_jax.models.synthetic import draw_torchvision_weights
    from sagm_jax.models.torchvision_weights import convert_torchvision, with_pretrained_backbone

    converted = convert_torchvision(draw_torchvision_weights("resnet18", seed=0), "resnet18")
    fresh = jax.tree.map(np.zeros_like, converted)
    fresh["params"]["conv1"]["kernel"] = np.zeros((7, 7, 4, 64), np.float32)
    fresh["params"]["classifier"] = {"kernel": np.ones((512, 5), np.float32),
                                     "bias": np.ones(5, np.float32)}
    merged = with_pretrained_backbone(fresh, converted)
    stem = converted["params"]["conv1"]["kernel"]
    for i in range(4):
        np.testing.assert_array_equal(merged["params"]["conv1"]["kernel"][:, :, i],
                                      stem[:, :, i % 3])
    np.testing.assert_array_equal(merged["params"]["layer1_0"]["conv1"]["kernel"],
                                  converted["params"]["layer1_0"]["conv1"]["kernel"])
    np.testing.assert_array_equal(merged["params"]["classifier"]["bias"], np.ones(5))


# ---------------------------------------------------------------- one tiny run each

SWAD = dict(swad=True, swad_eval_every=2, swad_n_converge=2, swad_n_tolerance=3,
            swad_tolerance_ratio=100.0)


@pytest.mark.slow
@pytest.mark.parametrize("objective,which,overrides", [("arm", "best", {}), ("mtl", "swad", SWAD)])
def test_recorded_accuracies_are_the_methods_prediction(tmp_path, objective, which, overrides):
    """A 3-step RotatedDigits run (ARM under SAGM, the digits default; MTL with SWAD):
    ``load_run`` gives the method's model, whose evaluation over the evaluator's batches
    reproduces the record; on the unpadded batches its argmax, counted here, is the
    evaluation's count (the padded last batch's count is the evaluator's own)."""
    from run_fixtures import assert_the_evaluation_reproduces_the_record, digits_config
    from sagm_jax.training import train

    config = digits_config(steps=3, objective=objective, test_envs=(0,), **overrides)
    train.train_and_evaluate(config, str(tmp_path))
    model, variables = assert_the_evaluation_reproduces_the_record(tmp_path, which)
    assert isinstance(model, networks.MethodModel) and "method" in variables["params"]
