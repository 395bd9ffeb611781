"""sagm_jax.methods.linear_probe: the classifier trained alone by its own Adam for
``linear_steps`` updates (DiWA's linear probe, ERM++'s linear phase), checked against a
float64 NumPy re-statement of torch's Adam on the classifier over fixed features, the
featurizer bit-identical during the probe, and the rule's Adam fresh after it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sagm_jax.config import config_problems
from sagm_jax.data import device_augment
from sagm_jax.methods.linear_probe import LinearProbeState, linear_probe
from sagm_jax.training.train import open_run, optimizer_from_config
from sagm_jax.training.train_step import create_train_state, run_train_step
from run_fixtures import digits_config

LINEAR_STEPS, STEPS, LR, LINEAR_LR, WD = 3, 5, 1e-3, 5e-3, 1e-2


@pytest.fixture(scope="module")
def probed():
    """Five SAGM steps of a RotatedDigits run (MNIST CNN, no dropout) whose first three
    are the probe's: the model, the initial variables, the model inputs of each step and
    the train states (the initial one first)."""
    config = digits_config(algorithm="sagm", linear_steps=LINEAR_STEPS, linear_lr=LINEAR_LR,
                           lr=LR, weight_decay=WD, steps=STEPS)
    program, variables = open_run(config)
    num_domains = len(program.train_envs)
    optimizer = optimizer_from_config(config, num_domains=num_domains)
    step = jax.jit(run_train_step(config, program.model, optimizer, num_domains))
    batches = program.dataset.train_iterator(program.train_envs, seed=config.seed,
                                             batch_per_env=config.batch_per_env)
    states, inputs = [create_train_state(variables, optimizer)], []
    key = jax.random.split(jax.random.key(config.seed))[1]
    for t, batch in zip(range(STEPS), batches):
        inputs.append(device_augment.model_inputs(batch, config.seed, t, config.image_size))
        states.append(step(states[-1], batch, key)[0])
    return program.model, variables, inputs, states, optimizer


def _numpy_probe(features, labels, w, b, steps):
    """torch.optim.Adam(lr=LINEAR_LR, weight_decay=WD) on logits = f @ w + b, the mean
    cross-entropy of each step's fixed features: float64 NumPy, written from torch's
    Adam (coupled decay g + wd * p; bias-corrected moments; eps 1e-8 outside the root)."""
    params = [w.copy(), b.copy()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t in range(steps):
        f, y = features[t], labels[t]
        logits = f @ params[0] + params[1]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        delta = (p - np.eye(w.shape[1])[y]) / len(y)
        grads = [f.T @ delta, delta.sum(0)]
        for i, (param, g) in enumerate(zip(params, grads)):
            g = g + WD * param
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            m_hat, v_hat = m[i] / (1 - 0.9 ** (t + 1)), v[i] / (1 - 0.999 ** (t + 1))
            params[i] = param - LINEAR_LR * m_hat / (np.sqrt(v_hat) + 1e-8)
    return params


def test_the_probe_is_torch_adam_on_the_classifier_over_fixed_features(probed):
    model, variables, inputs, states, _ = probed
    with jax.enable_x64(True):  # the features of each step's batch, once, in float64
        params64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64),
                                variables["params"])
        features = [np.asarray(model.apply({"params": params64}, jnp.asarray(
            np.asarray(x["image"]), jnp.float64), train=False, features=True)[0])
            for x in inputs[:LINEAR_STEPS]]
    labels = [np.asarray(x["label"]) for x in inputs[:LINEAR_STEPS]]
    head = variables["params"]["classifier"]
    w, b = _numpy_probe(features, labels, np.asarray(head["kernel"], np.float64),
                        np.asarray(head["bias"], np.float64), LINEAR_STEPS)
    ours = states[LINEAR_STEPS].params["classifier"]
    moved = np.abs(w - np.asarray(head["kernel"])).max()
    assert moved > LINEAR_LR  # the probe moved the classifier, by about lr per step
    np.testing.assert_allclose(np.asarray(ours["kernel"]), w, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(ours["bias"]), b, rtol=0, atol=2e-6)


def test_the_featurizer_is_bit_identical_during_the_probe_and_moves_after(probed):
    _, variables, _, states, _ = probed
    initial = {k: v for k, v in variables["params"].items() if k != "classifier"}
    for t in range(1, LINEAR_STEPS + 1):
        featurizer = {k: v for k, v in states[t].params.items() if k != "classifier"}
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)),
                                         featurizer, initial)), t
    after = {k: v for k, v in states[LINEAR_STEPS + 1].params.items() if k != "classifier"}
    assert not jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)),
                                         after, initial))


def test_the_rules_adam_is_fresh_at_linear_steps(probed):
    """At t = linear_steps the rule's state is its ``init``, and its first update is a
    fresh Adam's: with zero moments the bias-corrected step is lr * d / (|d| + 1e-8) for
    d = the direction plus the decay, so every coordinate whose |d| is well above 1e-8
    moves by lr (an Adam stepped before would move by other amounts)."""
    _, _, _, states, optimizer = probed
    fresh = optimizer.init(states[0].params).rule
    rule = states[LINEAR_STEPS].opt_state.rule
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), rule, fresh))
    before, after = states[LINEAR_STEPS].params, states[LINEAR_STEPS + 1].params
    moves = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))])
    # Coordinates whose direction is tiny move less; the bulk moves by exactly lr.
    assert np.mean(np.abs(moves - LR) < 1e-3 * LR) > 0.9
    assert moves.max() <= LR * (1 + 1e-3)


def test_a_traced_linear_steps_chooses_the_phase_on_the_device():
    """A pack's per-run linear_steps (traced, under vmap) gives each run the updates of
    its own Python-int probe."""
    params = {"body": jnp.ones(3), "classifier": {"kernel": jnp.arange(2.0), "bias": jnp.ones(1)}}
    grads = jax.tree.map(lambda p: 0.1 * p + 0.05, params)
    rule = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(0.01))

    def run(linear_steps, steps=3):
        opt = linear_probe(rule, linear_steps=linear_steps, learning_rate=0.1, weight_decay=0.0)
        state, p = opt.init(params), params
        for _ in range(steps):
            u, state = opt.update(grads, state, p)
            p = optax.apply_updates(p, u)
        return p

    traced = jax.jit(jax.vmap(run))(jnp.array([0, 2, 5]))
    for lane, n in enumerate((0, 2, 5)):
        alone = run(n)
        for got, want in zip(jax.tree.leaves(traced), jax.tree.leaves(alone)):
            np.testing.assert_allclose(got[lane], want, rtol=1e-6)
    assert isinstance(linear_probe(rule, linear_steps=1, learning_rate=0.1,
                                   weight_decay=0.0).init(params), LinearProbeState)


def test_linear_steps_is_refused_with_a_procedure_and_checked():
    problems = config_problems(digits_config(algorithm="fish", linear_steps=2))
    assert [p for p in problems if p.startswith("config.linear_steps=2: expected 0 with "
                                                "config.algorithm=fish")]
    assert any(p.startswith("config.linear_steps=-1: expected an integer >= 0")
               for p in config_problems(digits_config(linear_steps=-1)))
    assert not [p for p in config_problems(digits_config(algorithm="erm", linear_steps=2))
                if "linear" in p]


def test_a_pack_holds_probed_runs_or_unprobed_ones():
    """Runs whose linear_steps differ share a pack (a traced value) unless one of them has
    none: its optimizer state would then have the probe's structure, not its own."""
    from sagm_jax.training import packed

    base = digits_config(algorithm="erm").to_dict()
    assert packed.program_problems([{**base, "linear_steps": 3},
                                    {**base, "linear_steps": 5}]) == []
    problems = packed.program_problems([base, {**base, "linear_steps": 3}])
    assert [p for p in problems if p.startswith("linear_steps is 0 in some runs")]


def test_a_run_written_before_the_probe_is_the_same_run(tmp_path):
    """A config.json without the probe's and ERM++'s keys ran without them: relaunching
    it with their defaults is the same run; with a probe it is another."""
    import json

    from sagm_jax.training import rundir

    config = digits_config().to_dict()
    old = {k: v for k, v in config.items()
           if k not in ("linear_steps", "linear_lr", "lr_plateau", "lr_schedule")}
    (tmp_path / "config.json").write_text(json.dumps(old, default=str))
    assert rundir.config_differences(str(tmp_path), config) == []
    assert rundir.config_differences(str(tmp_path), {**config, "linear_steps": 3}) == [
        "linear_steps"]
