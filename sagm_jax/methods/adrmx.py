"""ADRMX (Demirel et al. 2023, "Additive Disentanglement of Domain Features with Remix
Loss") as DomainBed computes it: the procedure ``algorithm=adrmx``, its modules, its
prediction and its registry entry.

The reference is ``facebookresearch/DomainBed``, ``domainbed/algorithms.py``, class
``ADRMX``, with ``SupConLossLambda`` (``domainbed/lib/misc.py``), ``networks.MLP`` and
``networks.Classifier(..., is_nonlinear=True)`` (``domainbed/networks.py``); its
hyperparameters are ``domainbed/hparams_registry.py``'s ``ADRMX`` block.

Modules. ``f_l`` (``featurizer_label``) is the run's network's featurizer (its own linear
classifier is never used: it stays at init). ``f_d`` (``featurizer_domain``) is a second
copy of the network, taken from the run's step-0 variables, under
``params["method"]["featurizer_domain"]``. Under ``params["method"]`` too: the
discriminator ``D = MLP(F, M)`` (``adversarial.mlp_init``: ``mlp_width``,
``adrmx_mlp_depth``, ``mlp_dropout``) and three heads ``h_1`` (``classifier_label_1``,
F -> C), ``h_2`` (``classifier_label_2``, F -> C), ``h_d`` (``classifier_domain``,
F -> M), each DomainBed's nonlinear classifier
``Linear(F, F//2)-ReLU-Linear(F//2, F//4)-ReLU-Linear(F//4, out)`` at PyTorch's init.
Prediction (``ADRMX.predict``, ``self.network``): ``h_1(f_l(x))``.

One step on the batch X, Y (the M minibatches in order; ``e`` the rows' domains; ``t``
the updates before it, DomainBed's ``update_count`` being ``t + 1`` at its test)::

    z_l = f_l(X),  z_d = f_d(X),  z = z_l - z_d
    L_disc = CE(D(z), e)
    discriminator step when (t + 1) % (1 + k) < k   (k = adrmx_d_steps_per_g_step):
        D <- Adam_D(grad_D L_disc)
    generator step otherwise:
        L_dmn = CE(h_d(z_d), e)
        L_int = CE(h_1(z_l), Y),  L_cnt_int = SCL(z_l, Y, e)
        L_fin = CE(h_2(z), Y),    L_cnt_fin = SCL(z, Y, e)
        L_rmx = sum_{c < C} [n_c >= 2] CE(h_1(z[a_c] + z_d[b_c]), Y[a_c]) / C
        L_gen = L_int + L_fin + dclf_lambda L_dmn + rmxd_lambda L_rmx
                + cnt_lambda (L_cnt_int + L_cnt_fin) - disc_lambda L_disc
        (f_l, f_d, h_1, h_2, h_d) <- Adam_G(grad L_gen)

``Adam_D`` and ``Adam_G`` are PyTorch's Adam with the run's ``lr``, ``betas=(beta1,
0.9)`` and NO weight decay (the reference passes none: ``config.weight_decay`` does
nothing under ``adrmx``); each state, its count included, moves only on its own steps.

``SCL`` is ``SupConLossLambda(lamda=0.5, temperature=0.07)`` (:func:`supcon_loss`).
The remix pair of class c (:func:`remix_pairs`): with ``n_c`` the rows of class c,
``(a_c, b_c)`` are the first two entries of a random permutation of ``range(n_c)``,
used AS ROW INDICES OF THE WHOLE BATCH (the reference's ``perm[:2]``, not
``indices[perm[:2]]``): a quirk, reproduced by default; ``adrmx_remix_within_class=True``
takes rows ``a_c, b_c`` of class c instead (the fix). Classes with fewer than two rows
are skipped, the sum still divided by C.

Passes and draws (``key``, ``train_step``'s objective stream): ``f_l``'s pass draws its
dropout from ``fold_in(key, 0)``, ``f_d``'s from ``fold_in(key, 1)``, D's dropout from
``fold_in(key, 2)`` and the remix pairs from ``fold_in(key, 3)``. Every step runs both
featurizers forward and backward once (the reference's ``disc_loss.backward()`` also
reaches them): the passes stay outside the ``lax.cond`` that picks the optimizer
update, as in ``adversarial.py`` (XLA's CPU backend runs convolutions inside a
conditional slowly; docs/performance.md). ``f_d``'s pass runs the network at the copy's
parameters with the network's BatchNorm statistics: the procedures run with BatchNorm
frozen, and the copy's statistics are the network's at step 0.

Reported, as the reference's dicts: ``loss_disc`` every step; on generator steps
``loss_total`` (L_gen), ``loss_cnt_int``, ``loss_cnt_final``, ``loss_clf_int``,
``loss_clf_fin``, ``loss_dmn``, ``loss_remixed``, NaN on discriminator steps (a jitted
step returns the same keys every step); ``loss`` is ``loss_disc`` or ``loss_total``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sagm_jax.methods.adversarial import (
    ADAM_BETA2,
    NOT_COMPUTED,
    is_discriminator_step,
    mlp_apply,
    mlp_init,
)
from sagm_jax.methods.mdsdi import init_linear, linear
from sagm_jax.methods.networks import MethodNetwork, Shapes, join_params, split_params
from sagm_jax.methods.objectives import per_example_cross_entropy
from sagm_jax.methods.procedures import BatchPasses, Procedure, torch_adam
from sagm_jax.methods.registry import (
    Hyperparameter,
    Method,
    UpdateRule,
    choice,
    register_update_rule,
)

DOMAIN = "featurizer_domain"  # the copy of the network, in params["method"]
DISCRIMINATOR = "discriminator"
HEADS = ("classifier_label_1", "classifier_label_2", "classifier_domain")
# The parameter groups of the generator's Adam: the two featurizers and the three heads.
GENERATOR_GROUP = ("featurizer_label", DOMAIN) + HEADS
# ``SupConLossLambda(lamda=0.5)`` as ADRMX builds both of its losses; its default
# temperature, the 1e-5 it adds to the denominator and to the log's argument, and
# ``F.normalize``'s eps.
SUPCON_LAMBDA, SUPCON_TEMPERATURE, SUPCON_EPS, NORMALIZE_EPS = 0.5, 0.07, 1e-5, 1e-12
MIX_NUM = 1  # the reference's ``self.mix_num``: remix pairs per class
LABEL_PASS, DOMAIN_PASS, DISC_DROPOUT, REMIX_DRAWS = 0, 1, 2, 3  # fold_in of the step's key
LOSS_KEYS = ("loss_total", "loss_cnt_int", "loss_cnt_final", "loss_clf_int",
             "loss_clf_fin", "loss_dmn", "loss_remixed")


# ----------------------------------------------------------------------------
# Modules


def nonlinear_classifier_init(key, n_in: int, n_out: int) -> dict:
    """DomainBed's ``Classifier(n_in, n_out, is_nonlinear=True)``: Linear(n_in, n_in//2),
    Linear(n_in//2, n_in//4), Linear(n_in//4, n_out), at PyTorch's init."""
    keys = jax.random.split(key, 3)
    sizes = (n_in, n_in // 2, n_in // 4, n_out)
    return {f"layer_{k}": init_linear(keys[k], sizes[k], sizes[k + 1]) for k in range(3)}


def nonlinear_classify(params: dict, x) -> jax.Array:
    """``layer_2(relu(layer_1(relu(layer_0(x)))))`` in float32."""
    h = jax.nn.relu(linear(params["layer_0"], x))
    h = jax.nn.relu(linear(params["layer_1"], h))
    return linear(params["layer_2"], h)


def init_adrmx(key, shapes: Shapes, hp: dict, *, network) -> dict:
    """The method's variables at step 0: ``f_d``, the copy of the run's network at its
    step-0 parameters, the discriminator MLP and the three heads at PyTorch's init."""
    _, variables = network
    width, classes, domains = shapes.feature_dim, shapes.num_classes, shapes.num_domains
    if width < 4:
        raise ValueError(f"adrmx: the network's feature width is {width}; ADRMX's heads "
                         "(Linear(F, F//2), Linear(F//2, F//4), ...) need a width >= 4.")
    keys = jax.random.split(key, 4)
    params = {
        DOMAIN: jax.tree.map(jnp.array, variables["params"]),
        DISCRIMINATOR: mlp_init(keys[0], width, domains, int(hp["mlp_width"]),
                                int(hp["adrmx_mlp_depth"])),
        "classifier_label_1": nonlinear_classifier_init(keys[1], width, classes),
        "classifier_label_2": nonlinear_classifier_init(keys[2], width, classes),
        "classifier_domain": nonlinear_classifier_init(keys[3], width, domains),
    }
    return {"params": params}


def predict_adrmx(base, own, images, train, hp):
    """``h_1(f_l(x))``: the run's featurizer and ``classifier_label_1``."""
    del train, hp
    features, _ = base(images)
    return (features, nonlinear_classify(own["params"]["classifier_label_1"], features)), None


# ----------------------------------------------------------------------------
# The losses


def normalize(x) -> jax.Array:
    """``F.normalize(x, dim=1)``: ``x / max(|x|, 1e-12)`` per row; the norm carries no
    gradient where it is clamped (a zero row's gradient is finite, as PyTorch's)."""
    squared = jnp.sum(x * x, axis=1, keepdims=True)
    above = squared > NORMALIZE_EPS**2
    norm = jnp.where(above, jnp.sqrt(jnp.where(above, squared, 1.0)), NORMALIZE_EPS)
    return x / norm


def supcon_loss(features, labels, domains, lamda: float = SUPCON_LAMBDA,
                temperature: float = SUPCON_TEMPERATURE) -> jax.Array:
    """``SupConLossLambda(lamda, temperature)(features, labels, domains)``. With
    ``s_ij = <n_i, n_j> / T`` (n the normalised rows), ``w_ij = lamda`` for j in i's
    domain and ``1 - lamda`` otherwise, ``P_i`` the other rows of i's class::

        den_i  = sum_{j != i} w_ij exp(s_ij) + 1e-5
        l_i    = sum_{j in P_i} log(w_ij exp(s_ij) / den_i + 1e-5) / |P_i|
        loss   = -sum_{i: |P_i| > 0} l_i / (N - #{i: |P_i| = 0} + 1)

    (the reference skips the NaN ``l_i`` of a row without positives; the ``+ 1`` is its)."""
    n = normalize(features.astype(jnp.float32))
    similarity = n @ n.T / temperature
    others = ~jnp.eye(labels.shape[0], dtype=bool)
    positive = (labels[:, None] == labels[None, :]) & others
    weights = jnp.where(domains[:, None] == domains[None, :], lamda, 1.0 - lamda)
    scaled = weights * jnp.exp(similarity)
    denominator = jnp.sum(jnp.where(others, scaled, 0.0), axis=1) + SUPCON_EPS
    log_fraction = jnp.log(scaled / denominator[:, None] + SUPCON_EPS)
    count = jnp.sum(positive, axis=1)
    has_positive = count > 0
    per_row = jnp.sum(jnp.where(positive, log_fraction, 0.0), axis=1) / jnp.maximum(count, 1)
    skipped = jnp.sum(~has_positive)
    return -jnp.sum(jnp.where(has_positive, per_row, 0.0)) / (labels.shape[0] - skipped + 1)


def remix_pairs(key, labels, num_classes: int, within_class: bool = False):
    """Each class c's remix rows ``(a_c, b_c)`` [C] and whether it has them (``n_c >= 2``)
    [C]: ``a_c`` uniform on ``range(n_c)`` and ``b_c`` uniform on the rest (the first two
    entries of a uniform permutation), from ``fold_in(key, c)``. DomainBed's rows are
    ``a_c, b_c`` themselves; ``within_class`` takes the ``a_c``-th and ``b_c``-th rows of
    class c instead."""
    firsts, seconds, valid = [], [], []
    for c in range(num_classes):
        first_key, second_key = jax.random.split(jax.random.fold_in(key, c))
        is_c = labels == c
        count = jnp.sum(is_c)
        first = jax.random.randint(first_key, (), 0, jnp.maximum(count, 1))
        second = jax.random.randint(second_key, (), 0, jnp.maximum(count - 1, 1))
        second = second + (second >= first)
        if within_class:
            rows = jnp.nonzero(is_c, size=labels.shape[0], fill_value=0)[0]
            first, second = rows[first], rows[jnp.minimum(second, labels.shape[0] - 1)]
        firsts.append(first)
        seconds.append(second)
        valid.append(count >= 2)
    return jnp.stack(firsts), jnp.stack(seconds), jnp.stack(valid)


def generator_loss(heads: dict, label_features, domain_features, disc_loss_at, labels,
                   domains, pairs, hp: dict):
    """``L_gen`` (the module docstring) from both featurizers' outputs, the heads and
    ``disc_loss_at(z)`` (D's loss on the combined features); returns it and its terms
    under the reference's names."""
    combined = label_features - domain_features

    def mean_ce(logits, targets):
        return jnp.mean(per_example_cross_entropy(logits, targets))

    first, second, valid = pairs
    remixed = combined[first] + domain_features[second]
    remix_ce = per_example_cross_entropy(
        nonlinear_classify(heads["classifier_label_1"], remixed), labels[first])
    num_classes = first.shape[0]
    terms = {
        "loss_cnt_int": supcon_loss(label_features, labels, domains),
        "loss_cnt_final": supcon_loss(combined, labels, domains),
        "loss_clf_int": mean_ce(nonlinear_classify(heads["classifier_label_1"],
                                                   label_features), labels),
        "loss_clf_fin": mean_ce(nonlinear_classify(heads["classifier_label_2"], combined),
                                labels),
        "loss_dmn": mean_ce(nonlinear_classify(heads["classifier_domain"], domain_features),
                            domains),
        "loss_remixed": jnp.sum(jnp.where(valid, remix_ce, 0.0)) / (num_classes * MIX_NUM),
    }
    total = (terms["loss_clf_int"] + terms["loss_clf_fin"]
             + hp["dclf_lambda"] * terms["loss_dmn"] + hp["rmxd_lambda"] * terms["loss_remixed"]
             + hp["cnt_lambda"] * (terms["loss_cnt_int"] + terms["loss_cnt_final"])
             + hp["disc_lambda"] * -disc_loss_at(combined))
    return total, {"loss_total": total, **terms}


# ----------------------------------------------------------------------------
# Parameter groups and the update


def _featurizer(network_params: dict) -> dict:
    return {k: v for k, v in network_params.items() if k != "classifier"}


def generator_group(params: dict) -> dict:
    """What ``Adam_G`` holds: both featurizers (each network's parameters but its unused
    linear classifier) and the three heads."""
    network, own = split_params(params)
    return {"featurizer_label": _featurizer(network), DOMAIN: _featurizer(own[DOMAIN]),
            **{name: own[name] for name in HEADS}}


def as_updates(params: dict, generator=None, discriminator=None) -> dict:
    """A ``params``-shaped update: the given groups' updates, zeros elsewhere."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    network, own = split_params(zeros)
    if generator is not None:
        network = {**network, **generator["featurizer_label"]}
        own = {**own, **{name: generator[name] for name in HEADS},
               DOMAIN: {**own[DOMAIN], **generator[DOMAIN]}}
    if discriminator is not None:
        own = {**own, DISCRIMINATOR: discriminator}
    return join_params(network, own)


def adrmx_gradients(params: dict, passes: BatchPasses, key, hp: dict):
    """Both kinds of step's losses and gradients from one pass of each featurizer:
    ``(L_disc, grad_D L_disc, generator terms, grad of L_gen over generator_group)``."""
    network, own = split_params(params)
    images, labels = passes.images, passes.labels
    domains = jnp.repeat(jnp.arange(passes.num_domains), labels.shape[0] // passes.num_domains)

    def features_at(network_params, copy_params):
        label = passes.forward_at(join_params(network_params, own),
                                  jax.random.fold_in(key, LABEL_PASS))(images).features
        domain = passes.forward_at(join_params(copy_params, own),
                                   jax.random.fold_in(key, DOMAIN_PASS))(images).features
        return label.astype(jnp.float32), domain.astype(jnp.float32)

    (label_features, domain_features), pullback = jax.vjp(features_at, network, own[DOMAIN])

    def disc_loss_at(disc_params, combined):
        logits = mlp_apply(disc_params, combined, hp["mlp_dropout"],
                           jax.random.fold_in(key, DISC_DROPOUT))
        return jnp.mean(per_example_cross_entropy(logits, domains))

    disc_loss, disc_grads = jax.value_and_grad(disc_loss_at)(
        own[DISCRIMINATOR], label_features - domain_features)
    num_classes = own["classifier_label_1"]["layer_2"]["bias"].shape[0]
    pairs = remix_pairs(jax.random.fold_in(key, REMIX_DRAWS), labels, num_classes,
                        hp["adrmx_remix_within_class"])
    heads = {name: own[name] for name in HEADS}
    (_, terms), (head_grads, label_grads, domain_grads) = jax.value_and_grad(
        generator_loss, argnums=(0, 1, 2), has_aux=True)(
        heads, label_features, domain_features,
        lambda z: disc_loss_at(own[DISCRIMINATOR], z), labels, domains, pairs, hp)
    network_grads, copy_grads = pullback((label_grads, domain_grads))
    gen_grads = {"featurizer_label": _featurizer(network_grads),
                 DOMAIN: _featurizer(copy_grads), **head_grads}
    return disc_loss, disc_grads, terms, gen_grads


def adrmx(hp: dict, *, learning_rate: float, weight_decay: float,
          num_domains: int) -> Procedure:
    """ADRMX's step (the module docstring). The state is both Adams'
    (``{"discriminator", "generator"}``); DomainBed's optimizers take no weight decay."""
    del weight_decay, num_domains  # the reference passes no decay; the passes carry M
    betas = (hp["beta1"], ADAM_BETA2)
    disc_opt = torch_adam(learning_rate, 0.0, betas)
    gen_opt = torch_adam(learning_rate, 0.0, betas)

    def init(params):
        return {"discriminator": disc_opt.init(split_params(params)[1][DISCRIMINATOR]),
                "generator": gen_opt.init(generator_group(params))}

    def update(params, opt_state, passes: BatchPasses, key):
        disc_loss, disc_grads, terms, gen_grads = adrmx_gradients(params, passes, key, hp)

        def discriminator_step(_):
            steps, state = disc_opt.update(disc_grads, opt_state["discriminator"],
                                           split_params(params)[1][DISCRIMINATOR])
            return as_updates(params, discriminator=steps), {**opt_state,
                                                             "discriminator": state}

        def generator_step(_):
            steps, state = gen_opt.update(gen_grads, opt_state["generator"],
                                          generator_group(params))
            return as_updates(params, generator=steps), {**opt_state, "generator": state}

        disc_turn = is_discriminator_step(passes.step, hp["adrmx_d_steps_per_g_step"])
        updates, opt_state = jax.lax.cond(disc_turn, discriminator_step, generator_step, None)
        not_computed = jnp.asarray(NOT_COMPUTED, jnp.float32)
        reported = {k: jnp.where(disc_turn, not_computed, terms[k]) for k in LOSS_KEYS}
        return updates, opt_state, {
            "loss": jnp.where(disc_turn, disc_loss, terms["loss_total"]),
            "loss_disc": disc_loss, **reported}

    return Procedure(init, update, whole_batch=True)


# ----------------------------------------------------------------------------
# The registry's entry


def adrmx_by_dataset(dataset: str, mnist_like: bool) -> dict:
    """DomainBed's ADRMX ``lr``: 3e-3 from {5e-4, 1e-3, 2e-3, 3e-3} on its SMALL_IMAGES
    (the MNIST-like datasets), else 3e-5 from {2e-5, 3e-5, 4e-5, 5e-5}."""
    del dataset
    if mnist_like:
        return {"lr": (3e-3, choice((5e-4, 1e-3, 2e-3, 3e-3)))}
    return {"lr": (3e-5, choice((2e-5, 3e-5, 4e-5, 5e-5)))}


# DomainBed's ``hparams_registry.py`` ADRMX block, its single-value choices included (a
# draw of each keeps its default). beta1, mlp_width and mlp_dropout are DANN's keys
# (same DomainBed name, default and bounds); the depth and the discriminator steps have
# other defaults than DANN's, hence their own keys (DomainBed's names in the search).
ADRMX_HYPERPARAMETERS = (
    Hyperparameter("cnt_lambda", 1.0, "ADRMX: weight of the two supervised-contrastive "
                   "losses", ">= 0", choice((1.0,))),
    Hyperparameter("dclf_lambda", 1.0, "ADRMX: weight of the domain classifier's loss on "
                   "the domain features", ">= 0", choice((1.0,))),
    Hyperparameter("disc_lambda", 0.75, "ADRMX: weight of the adversarial term "
                   "(-discriminator loss) in the generator's loss", ">= 0", choice((0.75,))),
    Hyperparameter("rmxd_lambda", 1.0, "ADRMX: weight of the remix loss", ">= 0",
                   choice((1.0,))),
    Hyperparameter("adrmx_d_steps_per_g_step", 2, "ADRMX: discriminator steps per "
                   "generator step (DomainBed's d_steps_per_g_step)", "int >= 1",
                   choice((2,))),
    Hyperparameter("beta1", 0.5, "DANN: both Adams' beta1 (beta2 is 0.9)", "[0, 1)",
                   choice((0.5,))),
    Hyperparameter("mlp_width", 256, "DANN: the discriminator MLP's width", "int >= 1",
                   choice((256,))),
    Hyperparameter("adrmx_mlp_depth", 9, "ADRMX: the discriminator MLP's layers "
                   "(DomainBed's mlp_depth)", "int >= 2", choice((8, 9, 10))),
    Hyperparameter("mlp_dropout", 0.0, "DANN: the discriminator MLP's dropout", "[0, 1)",
                   choice((0.0,))),
    Hyperparameter("adrmx_remix_within_class", False, "ADRMX: remix two rows of the class "
                   "(the fix) instead of DomainBed's rows perm[:2] of the whole batch",
                   "bool"),
)

register_update_rule(UpdateRule(
    Method("adrmx", "ADRMX", ADRMX_HYPERPARAMETERS,
           "two featurizers (label, domain) disentangled additively against a "
           "discriminator MLP; CE, supervised-contrastive, domain and remix losses on "
           "three nonlinear heads", "DomainBed (Demirel et al. 2023)",
           by_dataset=adrmx_by_dataset),
    "procedure",
    lambda hp, **common: adrmx(hp, **common),
    network=MethodNetwork(init=init_adrmx, predict=predict_adrmx, init_from_network=True),
))
