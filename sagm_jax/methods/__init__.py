"""Every method: the registry (``registry``: labels, hyperparameters, sources, published
numbers, what composes with what), the objectives (``objectives``: the loss a step
minimises), the procedures (``procedures``: their own update from per-domain gradients)
and the sharpness-aware update rules (``update_rules``: SAM, GSAM, SAGM as optax
transforms)."""

from sagm_jax.methods.registry import (  # noqa: F401
    DISAM,
    DISAM_PUBLISHED,
    HEADS,
    OBJECTIVES,
    PROCEDURES,
    UPDATE_RULES,
    Distribution,
    Hyperparameter,
    Method,
    UpdateRule,
    choice,
    combination_problem,
    hyperparameters,
    log_uniform,
    markdown_table,
    method_label,
    owners,
    uniform,
)
