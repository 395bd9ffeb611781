"""Fishr (sagm_jax.methods.fishr) against a float64 re-statement of DomainBed's
``domainbed/algorithms.py`` (``Fishr``) and ``domainbed/lib/misc.py`` (``MovingAverage``
with its update counter and ``oneminusema_correction``, ``l2_between_dicts`` over the
sorted parameter names), written here in JAX x64: BackPACK's per-example gradients of
the linear classifier in closed form (torch's [C, d] weight layout), torch's Adam and
its restart. The package's code is never the reference. The network is a tiny dense
featurizer and classifier; whole train steps run through ``make_train_step``. One tiny
end-to-end run on RotatedDigits, and the sweep's draws of Fishr's hyperparameters under
DomainBed's names."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64_reference import TanhNet, adam_init, f64, ref_ce, tanh_net, torch_adam
from run_fixtures import digits_config, train_steps

from sagm_jax import methods
from sagm_jax.methods import fishr, networks, objectives
from sagm_jax.sweep.hparams import random_hparams
from sagm_jax.training import train

HEIGHT, WIDTH, CHANNELS, DIM, CLASSES = 3, 4, 2, 5, 4
M, B = 3, 4  # domains, rows per domain
LR = 0.01
TOL = {"rtol": 2e-4, "atol": 2e-6}


def TinyNet():
    return TanhNet(DIM, CLASSES)


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, HEIGHT, WIDTH, CHANNELS)).astype(np.float32),
            "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def fishr_hp(anneal=1, ema=0.8, lam=1000.0, correction="one_minus_ema"):
    return {"fishr_lambda": lam, "fishr_penalty_anneal_iters": anneal, "fishr_ema": ema,
            "fishr_ema_correction": correction}


def run_steps(hp, algorithm="erm", wd=0.0, steps=3, rule_hp=None):
    net = TinyNet()
    variables = net.init(jax.random.key(0), jnp.zeros((1, HEIGHT, WIDTH, CHANNELS)), train=False)
    shapes = networks.Shapes((HEIGHT, WIDTH, CHANNELS), DIM, CLASSES, M)
    own = methods.objective("fishr").network.init(jax.random.key(1), shapes, hp)
    variables = networks.with_method_variables(dict(variables), own)
    states, metrics = train_steps(net, variables, "fishr", hp, steps,
                                  lambda t: batch(M * B, seed=t), num_domains=M, lr=LR,
                                  wd=wd, key=7, algorithm=algorithm, rule_hp=rule_hp)
    return variables, states, metrics


# ---------------------------------------------------------------- float64 re-statement


ref_forward = tanh_net


def ref_batch_grad(h, logits, y):
    """BackPACK's ``BatchGrad`` of sum_i CE(z_i, y_i) for torch's Linear: per row,
    weight [C, d] = (softmax(z_i) - onehot(y_i)) outer h_i, bias [C] = softmax - onehot."""
    delta = jax.nn.softmax(logits) - jax.nn.one_hot(y, CLASSES, dtype=logits.dtype)
    return {"weight": (delta[:, :, None] * h[:, None, :]).reshape(len(h), -1), "bias": delta}


class RefMovingAverage:
    """``misc.MovingAverage``: the counter, zeros at the first update, the detached
    stored value, and the returned ``ema_data / (1 - ema)`` when corrected."""

    def __init__(self, ema, oneminusema_correction):
        self.ema, self.data, self.updates, self.correct = ema, {}, 0, oneminusema_correction

    def update(self, values):
        out = {}
        for name, data in values.items():
            data = data.reshape(1, -1)
            previous = jnp.zeros_like(data) if self.updates == 0 else self.data[name]
            ema_data = self.ema * previous + (1 - self.ema) * data
            out[name] = ema_data / (1 - self.ema) if self.correct else ema_data
            self.data[name] = jax.lax.stop_gradient(ema_data)
        self.updates += 1
        return out


def ref_l2_between_dicts(a, b):
    keys = sorted(a)
    return jnp.mean((jnp.concatenate([a[k].reshape(-1) for k in keys])
                     - jnp.concatenate([b[k].reshape(-1) for k in keys])) ** 2)


def ref_fishr_objective(p, x, y, averages, count, hp):
    """``Fishr.update``'s objective, nll and penalty at parameters ``p``."""
    h, logits = ref_forward(p, x)
    grads = ref_batch_grad(h, logits, y)
    per_domain = []
    for m in range(M):
        v = {}
        for name, g in grads.items():
            env = g[m * B:(m + 1) * B]
            v[name] = ((env - env.mean(0, keepdims=True)) ** 2).mean(0)
        per_domain.append(averages[m].update(v))
    mean = {name: jnp.stack([d[name] for d in per_domain]).mean(0) for name in per_domain[0]}
    penalty = sum(ref_l2_between_dicts(d, mean) for d in per_domain) / M
    nll = ref_ce(logits, y).mean()
    weight = hp["fishr_lambda"] if count >= hp["fishr_penalty_anneal_iters"] else 0.0
    return nll + weight * penalty, (nll, penalty)


def assert_close(got, want, **tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tol or TOL))


def ema_in_torch_layout(stored):
    """Our stored E (kernel [M, d, C], bias [M, C]) as the reference's flat [C*d], [C]."""
    kernel = np.asarray(stored["kernel"])
    return [{"weight": kernel[m].T.reshape(1, -1), "bias": np.asarray(stored["bias"])[m][None]}
            for m in range(M)]


# ---------------------------------------------------------------- tests


def test_per_example_gradients_are_a_loop_over_examples():
    """vmap(grad) of each row's loss equals the gradient of that row's loss alone, row by
    row (float64 jax.grad of the re-stated CE), and BackPACK's closed form."""
    rng = np.random.default_rng(3)
    head = {"kernel": jnp.asarray(rng.normal(size=(DIM, CLASSES)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=CLASSES), jnp.float32)}
    phi = rng.normal(size=(7, DIM)).astype(np.float32)
    y = rng.integers(0, CLASSES, 7)
    got = fishr.per_example_gradients(head, jnp.asarray(phi), jnp.asarray(y))
    with jax.enable_x64(True):
        h64 = f64(head)
        for i in range(len(phi)):
            def row(theta, i=i):
                logits = jnp.asarray(phi[i:i + 1], jnp.float64) @ theta["kernel"] + theta["bias"]
                return ref_ce(logits, jnp.asarray(y[i:i + 1]))[0]

            want = jax.grad(row)(h64)
            assert_close({k: got[k][i] for k in ("bias", "kernel")}, want, rtol=1e-5, atol=1e-6)
        closed = ref_batch_grad(jnp.asarray(phi, jnp.float64),
                                jnp.asarray(phi, jnp.float64) @ h64["kernel"] + h64["bias"],
                                jnp.asarray(y))
        np.testing.assert_allclose(np.asarray(got["kernel"]).transpose(0, 2, 1).reshape(7, -1),
                                   closed["weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("correction", ["one_minus_ema", "none"])
def test_three_adam_steps_match_domainbeds_update(correction):
    """Anneal 1: step 0 with penalty weight 0, Adam restarted before step 1, lambda from
    step 1; the parameters, loss, nll, penalty and the stored EMA after every step."""
    hp, wd = fishr_hp(correction=correction), 0.05
    variables, states, metrics = run_steps(hp, wd=wd)
    with jax.enable_x64(True):
        p = f64({k: variables["params"][k] for k in ("body", "classifier")})
        averages = [RefMovingAverage(hp["fishr_ema"], correction == "one_minus_ema")
                    for _ in range(M)]
        adam = adam_init(p)
        for t in range(3):
            data = batch(M * B, seed=t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            if t == hp["fishr_penalty_anneal_iters"] != 0:
                adam = adam_init(p)  # DomainBed's _init_optimizer

            def objective(q, x=x, y=y, t=t):
                return ref_fishr_objective(q, x, y, averages, t, hp)

            (value, (nll, penalty)), g = jax.value_and_grad(objective, has_aux=True)(p)
            p, adam = torch_adam(p, g, adam, LR, wd)
            got = states[t + 1]
            for key, want in (("loss", value), ("nll", nll), ("penalty", penalty)):
                np.testing.assert_allclose(float(metrics[t][key]), float(want), **TOL)
            assert_close({k: got.params[k] for k in ("body", "classifier")}, p)
            stored = ema_in_torch_layout(got.batch_stats["method"][fishr.EMA_KEY])
            assert_close(stored, [a.data for a in averages])
    assert float(metrics[1]["penalty"]) > 0 and float(metrics[0]["loss"]) == float(
        metrics[0]["nll"])


def test_ema_advances_once_per_sagm_step_and_second_pass_reads_the_stored_ema():
    """Under SAGM the EMA after each step is ema E + (1 - ema) v(w_t) of the clean pass at
    the step's weights; a second evaluation (advance=False) leaves E as given."""
    hp = fishr_hp(anneal=0, ema=0.6)
    _, states, _ = run_steps(hp, algorithm="sagm", steps=2, rule_hp={"rho": 0.5, "alpha": 0.01})
    with jax.enable_x64(True):
        averages = [RefMovingAverage(0.6, True) for _ in range(M)]
        for t in range(2):
            data = batch(M * B, seed=t)
            x, y = jnp.asarray(data["image"], jnp.float64), jnp.asarray(data["label"])
            ref_fishr_objective(f64(states[t].params), x, y, averages, t, hp)
            stored = states[t + 1].batch_stats["method"][fishr.EMA_KEY]
            assert_close(ema_in_torch_layout(stored), [a.data for a in averages])
    state = states[1]
    data = batch(M * B, seed=5)

    def forward(images):
        h, logits = TinyNet().apply({"params": state.params}, images, train=True, features=True)
        return objectives.Outputs(h, logits, state.batch_stats)

    _, aux = objectives.objective_loss(
        "fishr", hp, forward, jnp.asarray(data["image"]), jnp.asarray(data["label"]),
        num_domains=M, state={}, step=jnp.int32(1), key=jax.random.key(0), advance=False,
        params=state.params)
    assert_close(aux.batch_stats["method"], state.batch_stats["method"], rtol=0, atol=0)


def test_registry_restart_and_a_missing_classifier():
    assert objectives.reset_optimizer_step("fishr", {"fishr_penalty_anneal_iters": 4}) == 4
    assert objectives.reset_optimizer_step("fishr", {}) == 1500
    assert methods.method_label("fishr", "erm") == "Fishr"
    with pytest.raises(ValueError, match=r"params\['classifier'\]"):
        objectives.objective_loss(
            "fishr", {}, lambda x: None, jnp.zeros((2, 1)), jnp.zeros(2, jnp.int32),
            num_domains=2, state={}, step=jnp.int32(0), key=jax.random.key(0), advance=True,
            params={"body": {}})


def db_seed_hash(*args):
    return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2**31)


@pytest.mark.parametrize("hparams_seed", [0, 4])
def test_sweep_draws_fishrs_hyperparameters_under_domainbeds_names(hparams_seed):
    """DomainBed's ``hparams_registry`` for Fishr: lambda 10^U(1,4), penalty_anneal_iters
    int(U(0,5000)), ema U(0.9,0.99), each from RandomState(seed_hash(s, name))."""
    got = random_hparams("erm", "PACS", hparams_seed, 1, objective="fishr")
    if hparams_seed == 0:
        want = {"fishr_lambda": 1000.0, "fishr_penalty_anneal_iters": 1500, "fishr_ema": 0.95}
    else:
        s = db_seed_hash(hparams_seed, 1)

        def draw(name):
            return np.random.RandomState(db_seed_hash(s, name))

        want = {"fishr_lambda": 10 ** draw("lambda").uniform(1.0, 4.0),
                "fishr_penalty_anneal_iters": int(draw("penalty_anneal_iters").uniform(0, 5000)),
                "fishr_ema": draw("ema").uniform(0.90, 0.99)}
    assert {k: got[k] for k in want} == want
    assert "fishr_ema_correction" not in got  # no DomainBed draw: the config's value stays


def test_fishr_under_sagm_trains_on_rotated_digits(tmp_path):
    """The penalty switches on and Adam restarts inside the run (anneal 1); the records
    carry DomainBed's loss, nll and penalty."""
    records = train.train_and_evaluate(
        digits_config(objective="fishr", algorithm="sagm", steps=2, eval_every=1,
                      fishr_penalty_anneal_iters=1), str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r[k]) for r in records for k in ("loss", "nll", "penalty"))
    assert records[-1]["penalty"] > 0
    # weight 0 at step 0, fishr_lambda from step 1 (each record is one step's values)
    assert records[0]["loss"] == records[0]["nll"] and records[1]["loss"] > records[1]["nll"]
