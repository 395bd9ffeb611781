"""MIRO (sagm_jax.methods.miro) against a float64 re-statement of ``khanrc/miro``'s
``domainbed/algorithms/miro.py`` (``MIRO.update``, ``MeanEncoder``, ``VarianceEncoder``)
with PyTorch's Adam over its three param groups (the encoders at ``lr * lr_mult``),
written here in JAX x64; the package's code is never the reference. The network is a
tiny two-layer featurizer that sows a ``stem`` and a ``block1`` feature (``TinyNet``);
whole train steps run through ``make_train_step``. The ResNet's and the MNIST CNN's
intermediate features are checked against their layers applied directly, the oracle
stays bit-identical through a sharpness-aware run with trained BatchNorm. SAGM + MIRO
with SWAD trains end to end and resumes exactly in tests/methods/test_method_runs.py."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sagm_jax.methods import miro, networks
from sagm_jax.methods.update_rules import rule_optimizer
from sagm_jax.models.resnet import INTERMEDIATES
from sagm_jax.training.train_step import StepMethod, create_train_state, make_train_step

from float64_reference import f64

HEIGHT, WIDTH, CHANNELS, STEM, WIDTH1, CLASSES = 3, 2, 2, 4, 5, 3
M, B = 2, 3
LR, WD, LR_MULT, LD = 0.01, 0.05, 10.0, 0.5
TOL = dict(rtol=2e-4, atol=2e-6)


class TinyNet(nn.Module):
    """stem = relu(x @ Ws + bs) (a 1x1 conv), block1 = tanh(stem @ W1 + b1), both sown;
    features = spatial mean of block1, logits = features @ classifier. ``batchnorm``
    adds a BatchNorm after the stem (for the oracle's statistics)."""

    batchnorm: bool = False
    freeze_batchnorm: bool = True

    @nn.compact
    def __call__(self, x, train: bool, mixstyle: bool = False, features: bool = False):
        h = nn.Dense(STEM, name="conv_stem")(x)
        if self.batchnorm:
            h = nn.BatchNorm(use_running_average=self.freeze_batchnorm or not train,
                             momentum=0.9, name="bn")(h)
        h = nn.relu(h)
        self.sow(INTERMEDIATES, "stem", h)
        h = jnp.tanh(nn.Dense(WIDTH1, name="layer1")(h))
        self.sow(INTERMEDIATES, "block1", h)
        pooled = h.mean(axis=(1, 2))
        logits = nn.Dense(CLASSES, name="classifier")(pooled)
        return (pooled, logits) if features else logits


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def hparams(**overrides):
    return {"miro_ld": LD, "miro_lr_mult": LR_MULT, "miro_feat_layers": "stem_block",
            **overrides}


def build(net, hp):
    """TinyNet's variables with MIRO's (the encoders and the oracle), as training builds them."""
    variables = dict(net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)),
                              train=False))
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), WIDTH1, CLASSES, M)
    own = networks.init_method_variables(miro.MIRO_NETWORK, jax.random.key(1), shapes, hp,
                                         base=(net, variables))
    return networks.with_method_variables(variables, own)


def run_steps(net, hp, algorithm="erm", steps=2, train_batchnorm=False, rule_hp=None):
    variables = build(net, hp)
    opt = rule_optimizer(algorithm, rule_hp or {}, learning_rate=LR, weight_decay=WD,
                         group_learning_rates=networks.group_learning_rates(
                             miro.MIRO_NETWORK, hp))
    step = jax.jit(make_train_step(net, opt, algorithm=algorithm, train_batchnorm=train_batchnorm,
                                   method=StepMethod("miro", hp, M)))
    states, metrics = [create_train_state(variables, opt, {})], []
    for t in range(steps):
        state, m = step(states[-1], batch(M * B, seed=t), jax.random.key(7))
        states.append(state)
        metrics.append(m)
    return variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement




def ref_features(p, x):
    """The reference's featurizer with hooks: ([stem, block1] features, logits)."""
    stem = jnp.maximum(x @ p["conv_stem"]["kernel"] + p["conv_stem"]["bias"], 0.0)
    block1 = jnp.tanh(stem @ p["layer1"]["kernel"] + p["layer1"]["bias"])
    logits = block1.mean(axis=(1, 2)) @ p["classifier"]["kernel"] + p["classifier"]["bias"]
    return {"stem": stem, "block1": block1}, logits


def ref_regulariser(feats, pre_feats, b):
    """sum over layers of vlb.mean() / 2, vlb = (mean - pre_f)^2 / var + log var,
    mean = f (MeanEncoder), var = softplus(b) + 1e-5 (VarianceEncoder, channelwise)."""
    total = 0.0
    for layer in feats:
        var = jnp.log1p(jnp.exp(b[layer])) + 1e-5
        total = total + jnp.mean((feats[layer] - pre_feats[layer]) ** 2 / var + jnp.log(var)) / 2
    return total


def ref_loss(net_params, b, oracle_params, x, y, ld):
    """MIRO.update's loss: CE(logit, y) + ld * reg_loss, and (loss, reg_loss)."""
    feats, logits = ref_features(net_params, x)
    pre, _ = ref_features(oracle_params, x)
    log_probs = logits - jax.scipy.special.logsumexp(logits, axis=1, keepdims=True)
    ce = -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))
    reg = ref_regulariser(feats, jax.lax.stop_gradient(pre), b)
    loss = ce + ld * reg
    return loss, (loss, reg)


def ref_adam(w, g, m, v, t, lr):
    """torch.optim.Adam with coupled weight decay (betas 0.9, 0.999; eps 1e-8)."""
    d = g + WD * w
    m, v = 0.9 * m + 0.1 * d, 0.999 * v + 0.001 * d * d
    step = lr * (m / (1 - 0.9 ** t)) / (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    return w - step, m, v


# ---------------------------------------------------------------- tests


def test_regulariser_and_gradients_match_the_reference():
    rng = np.random.default_rng(3)
    feats = {"stem": rng.normal(size=(4, 3, 2, 5)), "block1": rng.normal(size=(4, 2, 1, 6))}
    pre = {k: v + rng.normal(0, 0.5, v.shape) for k, v in feats.items()}
    b = {"stem": rng.normal(size=5), "block1": rng.normal(size=6)}
    as32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)  # noqa: E731
    value, grads = jax.value_and_grad(miro.regulariser, argnums=(0, 1, 2))(
        as32(feats), as32(pre), as32(b))
    with jax.enable_x64(True):
        ref_value, ref_grads = jax.value_and_grad(ref_regulariser, argnums=(0, 2))(
            f64(feats), f64(pre), f64(b))
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for ours, ref in zip(jax.tree.leaves((grads[0], grads[2])), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-8)
    assert all(not np.any(g) for g in jax.tree.leaves(grads[1]))  # the oracle is constant
    # The variance starts at the reference's 0.1.
    np.testing.assert_allclose(miro.variance(miro.initial_variance_bias()), 0.1, rtol=1e-6)


def test_two_adam_steps_match_the_reference():
    """Every parameter (network and encoders) after two steps of erm + MIRO, lr_mult 10
    and weight decay, and the reported loss and reg_loss of each step."""
    hp = hparams()
    variables, states, metrics = run_steps(TinyNet(), hp)
    assert set(variables["params"]["method"]["variance"]) == {"stem", "block1"}
    with jax.enable_x64(True):
        net = f64({k: v for k, v in variables["params"].items() if k != "method"})
        b = f64(variables["params"]["method"]["variance"])
        oracle = f64(net)  # the network at step 0
        groups = [(net, LR), (b, LR * LR_MULT)]  # torch's param groups and their lr
        moments = [jax.tree.map(lambda w: (0.0 * w, 0.0 * w), g) for g, _ in groups]
        # Compiled (op by op, the re-statement compiled 200 small programs).
        ref_grad = jax.jit(jax.grad(ref_loss, argnums=(0, 1), has_aux=True))
        adam = jax.jit(ref_adam)
        for t in range(2):
            data = batch(M * B, seed=t)
            grads, (loss, reg) = ref_grad(
                groups[0][0], groups[1][0], oracle, jnp.asarray(data["image"], jnp.float64),
                data["label"], LD)
            np.testing.assert_allclose(metrics[t]["loss"], loss, **TOL)
            np.testing.assert_allclose(metrics[t]["reg_loss"], reg, **TOL)
            for k, ((w, lr), g) in enumerate(zip(groups, grads)):
                stepped = jax.tree.map(
                    lambda w_, g_, mv, lr=lr: adam(w_, g_, mv[0], mv[1], t + 1, lr),
                    w, g, moments[k], is_leaf=lambda n: isinstance(n, tuple))
                is_triple = lambda n: isinstance(n, tuple) and len(n) == 3  # noqa: E731
                groups[k] = (jax.tree.map(lambda r: r[0], stepped, is_leaf=is_triple), lr)
                moments[k] = jax.tree.map(lambda r: (r[1], r[2]), stepped, is_leaf=is_triple)
    final = states[-1].params
    for layer in ("stem", "block1"):
        np.testing.assert_allclose(final["method"]["variance"][layer], groups[1][0][layer], **TOL)
    for key in ("conv_stem", "layer1", "classifier"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_allclose(final[key][leaf], groups[0][0][key][leaf], **TOL)


def test_the_oracle_stays_bit_identical():
    """SAGM + MIRO with trained BatchNorm and weight decay: the network and its statistics
    move, the oracle (params and statistics) in batch_stats["method"] does not."""
    net = TinyNet(batchnorm=True, freeze_batchnorm=False)
    variables, states, _ = run_steps(net, hparams(), algorithm="sagm", steps=3,
                                     train_batchnorm=True, rule_hp={"rho": 0.05, "alpha": 1e-3})
    oracle = variables["batch_stats"]["method"]["oracle"]
    assert set(oracle) == {"params", "batch_stats"}
    final = states[-1]
    assert not np.allclose(final.params["conv_stem"]["kernel"],
                       variables["params"]["conv_stem"]["kernel"])
    assert not np.allclose(final.batch_stats["bn"]["mean"], variables["batch_stats"]["bn"]["mean"])
    kept = final.batch_stats["method"]["oracle"]
    assert jax.tree.structure(kept) == jax.tree.structure(oracle)
    for ours, initial in zip(jax.tree.leaves(kept), jax.tree.leaves(oracle)):
        np.testing.assert_array_equal(ours, initial)
    # The oracle is a copy of the step-0 network, not a view of the trained parameters.
    network_params = {k: v for k, v in variables["params"].items() if k != "method"}
    for ours, initial in zip(jax.tree.leaves(oracle["params"]), jax.tree.leaves(network_params)):
        np.testing.assert_array_equal(ours, initial)
    # The optimizer holds nothing of the oracle: Adam's moments cover params only.
    assert "oracle" not in str(jax.tree.structure(final.opt_state))


def _init_and_apply(model, x):
    """The model's variables and, at them in eval mode, its logits, its sown intermediates
    in the order sown, and its logits without sowing. Compiled, and drawn with the "rbg"
    generator: run eagerly, or compiled with threefry's draws, the init took seconds."""
    order = []

    def run(x):
        variables = model.init(jax.random.key(1, impl="rbg"), x, train=False)
        logits, sown = model.apply(variables, x, train=False, mutable=[INTERMEDIATES])
        order.extend(sown[INTERMEDIATES])  # jit's outputs sort a dict's keys
        return variables, logits, sown[INTERMEDIATES], model.apply(variables, x, train=False)

    variables, logits, sown, plain = jax.jit(run)(x)
    return variables, logits, {k: sown[k][0] for k in order}, plain


def test_resnet_intermediates_are_its_layers_outputs():
    from sagm_jax.models import resnet

    model = resnet.ResNet("resnet18", num_classes=3)
    x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    variables, logits, sown, plain = _init_and_apply(model, x)
    np.testing.assert_array_equal(logits, plain)
    assert list(sown) == ["stem", "block1", "block2", "block3", "block4"]
    assert [v.shape[-1] for v in sown.values()] == [64, 64, 128, 256, 512]
    p, s = variables["params"], variables["batch_stats"]

    def layer(module, name, h):
        return jax.jit(module.apply)(
            {"params": p[name], **({"batch_stats": s[name]} if name in s else {})}, h)

    stem = layer(resnet.Conv(64, 7, 2), "conv1", x)
    stem = jax.nn.relu(layer(resnet.batchnorm(True, "bn1"), "bn1", stem))
    stem = jax.lax.reduce_window(stem, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                 ((0, 0), (1, 1), (1, 1), (0, 0)))
    np.testing.assert_allclose(sown["stem"], stem, rtol=1e-5, atol=1e-5)
    block = layer(resnet.BasicBlock(64, 1, True), "layer1_0", sown["stem"])
    block = layer(resnet.BasicBlock(64, 1, True), "layer1_1", block)
    np.testing.assert_allclose(sown["block1"], block, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, sown["block4"].mean((1, 2)) @ p["classifier"]["kernel"]
                               + p["classifier"]["bias"], rtol=1e-5, atol=1e-5)


def test_mnist_cnn_intermediates_are_its_conv_blocks():
    from sagm_jax.models.mnist_cnn import MnistCNN

    model = MnistCNN(num_classes=3, widths=(8, 8, 8, 16))
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
    variables, _, sown, _ = _init_and_apply(model, x)
    assert [(k, v.shape) for k, v in sown.items()] == [
        ("block1", (2, 8, 8, 8)), ("block2", (2, 4, 4, 8)), ("block3", (2, 4, 4, 8)),
        ("block4", (2, 4, 4, 16))]
    p = variables["params"]
    h = jax.lax.conv_general_dilated(x, p["conv1"]["kernel"], (1, 1), ((1, 1), (1, 1)),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h + p["conv1"]["bias"]).reshape(2, 8, 8, 8, 1)  # 8 groups of 1 channel
    h = (h - h.mean((1, 2, 4), keepdims=True)) / jnp.sqrt(h.var((1, 2, 4), keepdims=True) + 1e-5)
    h = h.reshape(2, 8, 8, 8) * p["groupnorm1"]["scale"] + p["groupnorm1"]["bias"]
    np.testing.assert_allclose(sown["block1"], h, rtol=1e-4, atol=1e-5)
    # Both settings regularise the CNN's four blocks (it has no stem).
    assert miro.feature_layers("stem_block", sown) == miro.feature_layers("block", sown)


def test_the_config_trains_the_encoders_at_lr_mult():
    """optimizer_from_config: objective=miro scales the updates of params["method"] by
    miro_lr_mult after Adam; the network's are Adam's at lr."""
    from sagm_jax.config import mnist_config
    from sagm_jax.training.train import optimizer_from_config

    config = mnist_config("RotatedDigits")
    config.update(dict(objective="miro", algorithm="erm", miro_lr_mult=7.0, lr=0.1))
    params = {"w": jnp.ones(3), "method": {"variance": {"stem": jnp.ones(2)}}}
    grads = {"w": jnp.full(3, 0.5), "method": {"variance": {"stem": jnp.full(2, 0.5)}}}
    opt = optimizer_from_config(config)
    updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1, rtol=1e-4)  # Adam's first step: -lr
    np.testing.assert_allclose(updates["method"]["variance"]["stem"], 7.0 * updates["w"][:2],
                               rtol=1e-6)
