"""Every method: the registries (``registry``: each objective's and update rule's
builder, label, hyperparameters, source, published numbers and what composes with
what), the objectives (``objectives``: the loss a step minimises), the sharpness-aware
update rules (``update_rules``: SAM, GSAM, SAGM as optax transforms) and the procedures
(``procedures``: their own update from per-domain gradients). Importing the package
fills the registries: each module registers its own entries."""

from sagm_jax.methods.registry import (  # noqa: F401
    AVERAGINGS,
    AVERAGING_PUBLISHED,
    averaging_label,
    DISAM,
    DISAM_PUBLISHED,
    SWAD_PUBLISHED,
    published,
    published_text,
    KINDS,
    OBJECTIVES,
    UPDATE_RULES,
    Distribution,
    Hyperparameter,
    Method,
    Objective,
    UpdateRule,
    choice,
    combination_problem,
    fixed,
    hyperparameters,
    log_uniform,
    markdown_table,
    method_label,
    objective,
    owners,
    register_objective,
    register_update_rule,
    rule_names,
    settings,
    uniform,
    update_rule,
)
from sagm_jax.methods import (  # noqa: F401,E402  (each registers its entries)
    objectives, procedures, update_rules, representation, adaptive, adversarial, style, miro,
    mdsdi, decoupling, causal, bottleneck, contrastive, fishr, quantile, sand_mask, transfer,
    inter_gradient, risk_distribution, uniform_risk, trm, adrmx,
)
