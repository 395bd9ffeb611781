"""The one table of objectives and the one table of update rules.

A run is ``objective x update rule (+ DISAM)``:

* an OBJECTIVE (``config.objective``, :data:`OBJECTIVES`) is the loss one step minimises
  from the per-domain minibatches (``sagm_jax.methods.objectives`` computes them);
* an UPDATE RULE (``config.algorithm``, :data:`UPDATE_RULES`) turns that loss into an
  update: plain Adam (``erm``), a sharpness-aware optax head before Adam
  (``sam``, ``gsam``, ``sagm``, ``erm_sam``; ``sagm_jax.methods.update_rules``), or a procedure that
  is its own update (``fish``, ``and_mask``, ``mldg``; ``sagm_jax.methods.procedures``);
* DISAM (``config.disam_lambda`` > 0) replaces the ascent gradient of a head by the
  domain-variance one (``sagm_jax.methods.update_rules``; docs/methods.md, "DISAM").

Each entry names its label (the tables' row), its own hyperparameters (config key,
default, meaning, bounds, and DomainBed's random distribution where it has one), its
source and the published numbers; the config fields, their checks, the sweep's
choices, the collector's row names and the README's table are read from here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class Distribution(NamedTuple):
    """DomainBed's random draw of one hyperparameter: ``draw(numpy RandomState)``."""

    text: str
    draw: Callable[[np.random.RandomState], object]


def log_uniform(low: float, high: float, integer: bool = False) -> Distribution:
    """``10 ** U(low, high)`` (``int(...)`` when ``integer``), as DomainBed writes it."""

    def draw(rng):
        value = 10 ** rng.uniform(low, high)
        return int(value) if integer else float(value)

    text = f"10^U({low:g},{high:g})"
    return Distribution(f"int({text})" if integer else text, draw)


def uniform(low: float, high: float) -> Distribution:
    return Distribution(f"U({low:g},{high:g})", lambda rng: float(rng.uniform(low, high)))


def choice(values: tuple) -> Distribution:
    text = "{" + ", ".join(f"{v:g}" for v in values) + "}"
    return Distribution(text, lambda rng: values[rng.choice(len(values))])


class Hyperparameter(NamedTuple):
    """One hyperparameter of a method: its config key, default, meaning, bounds (an
    interval as ``sagm_jax.config`` writes it: ``"> 0"``, ``">= 0"``, ``"[0, 1]"``, or
    ``"int >= 1"``) and DomainBed's random distribution (None where it has none)."""

    key: str
    default: object
    meaning: str
    bounds: str
    distribution: Distribution | None = None


class Method(NamedTuple):
    """One objective or update rule."""

    name: str  # the config value
    label: str  # the tables' and the README's name
    hyperparameters: tuple[Hyperparameter, ...]
    summary: str  # one line for the README and --help
    source: str  # where it comes from
    # Published test-domain accuracy (PACS, VLCS, OfficeHome, TerraInc, DomainNet, avg) and
    # where it is printed (the last element); () where none is.
    published: tuple = ()


class UpdateRule(NamedTuple):
    method: Method
    # "plain" (Adam), "head" (a sharpness-aware optax head before Adam) or "procedure"
    # (its own update from per-domain gradients).
    kind: str

    @property
    def name(self) -> str:
        return self.method.name


_MIXUP_ALPHA = Hyperparameter(
    "mixup_alpha", 0.2, "Mixup's Beta(alpha, alpha) for the mixing weight", "> 0",
    log_uniform(-1, 1),
)
_MMD_GAMMA = Hyperparameter(
    "mmd_gamma", 1.0, "weight of the CORAL/MMD feature penalty", ">= 0", log_uniform(-1, 1)
)

OBJECTIVES: dict[str, Method] = {
    m.name: m
    for m in (
        Method("erm", "ERM", (), "mean cross-entropy of the concatenated minibatches",
               "DomainBed", (85.5, 77.5, 66.5, 46.1, 40.9, 63.3, "DomainBed")),
        Method("mixup", "Mixup", (_MIXUP_ALPHA,),
               "inter-domain Mixup: one Beta weight per cyclic pair of shuffled domains",
               "DomainBed (Yan et al. 2020)", (84.6, 77.4, 68.1, 47.9, 39.2, 63.4, "DomainBed")),
        Method("cutmix", "CutMix", (
            Hyperparameter("cutmix_beta", 1.0, "CutMix's Beta(beta, beta) for the box area",
                           ">= 0"),
            Hyperparameter("cutmix_prob", 1.0, "probability that a step cuts and mixes",
                           "[0, 1]"),
        ), "one box pasted from a shuffled batch, labels mixed by the box's area",
               "SAGM repository (Yun et al. 2019)"),
        Method("coral", "CORAL", (_MMD_GAMMA,),
               "ERM + gamma * mean over domain pairs of the feature mean/covariance gap",
               "DomainBed (Sun & Saenko 2016)", (86.2, 78.8, 68.7, 47.6, 41.5, 64.6, "DomainBed")),
        Method("mmd", "MMD", (_MMD_GAMMA,),
               "ERM + gamma * mean over domain pairs of a multi-bandwidth Gaussian MMD",
               "DomainBed (Li et al. 2018)", (84.6, 77.5, 66.3, 42.2, 23.4, 58.8, "DomainBed")),
        Method("groupdro", "GroupDRO", (
            Hyperparameter("groupdro_eta", 1e-2, "step size of the domain weights q", "> 0",
                           log_uniform(-3, -1)),
        ), "domain losses weighted by q, q <- q * exp(eta * loss) each step",
               "DomainBed (Sagawa et al. 2020)", (84.4, 76.7, 66.0, 43.2, 33.3, 60.7, "DomainBed")),
        Method("irm", "IRM", (
            Hyperparameter("irm_lambda", 1e2, "weight of IRM's penalty after the anneal",
                           ">= 0", log_uniform(-1, 5)),
            Hyperparameter("irm_penalty_anneal_iters", 500,
                           "steps with penalty weight 1; Adam restarts at this step",
                           "int >= 0", log_uniform(0, 4, integer=True)),
        ), "mean domain loss + lambda * IRMv1 penalty (split-batch estimate)",
               "DomainBed (Arjovsky et al. 2019)", (83.5, 78.5, 64.3, 47.6, 33.9, 61.6, "DomainBed")),
        Method("vrex", "VREx", (
            Hyperparameter("vrex_lambda", 1e1, "weight of the variance penalty after the anneal",
                           ">= 0", log_uniform(-1, 5)),
            Hyperparameter("vrex_penalty_anneal_iters", 500,
                           "steps with penalty weight 1; Adam restarts at this step",
                           "int >= 0", log_uniform(0, 4, integer=True)),
        ), "mean domain loss + lambda * variance of the domain losses",
               "DomainBed (Krueger et al. 2021)", (84.9, 78.3, 66.4, 46.4, 33.6, 61.9, "DomainBed")),
    )
}

UPDATE_RULES: dict[str, UpdateRule] = {
    rule.name: rule
    for rule in (
        UpdateRule(Method("erm", "ERM", (), "Adam on the objective's gradient", "DomainBed",
                          (85.5, 77.3, 66.5, 46.1, 43.8, 63.9, "SAGM paper")), "plain"),
        UpdateRule(Method("sam", "SAM", (), "gradient at w + rho g/||g||", "Foret et al. 2021"),
                   "head"),
        UpdateRule(Method("gsam", "GSAM", (), "SAM minus alpha times the clean gradient's part "
                          "orthogonal to it", "Zhuang et al. 2022"), "head"),
        UpdateRule(Method("sagm", "SAGM", (), "mean of the gradients at w and at "
                          "w + (rho/||g|| - alpha) g", "Wang et al. 2023",
                          (86.6, 80.0, 70.1, 48.8, 45.0, 66.1, "SAGM paper")), "head"),
        UpdateRule(Method("erm_sam", "ERM + SAM", (), "SAGM with alpha 0 (the paper's Table 3)",
                          "Wang et al. 2023"), "head"),
        UpdateRule(Method("fish", "Fish", (
            Hyperparameter("fish_meta_lr", 0.5, "Fish's meta step toward the inner weights",
                           "(0, 1]", choice((0.05, 0.1, 0.5))),
        ), "inner Adam over the domains in turn (its state persists), then "
           "w <- w + meta_lr (w' - w)", "DomainBed (Shi et al. 2022)",
            (85.5, 77.8, 68.6, 45.1, 42.7, 63.9, "SAGM paper")), "procedure"),
        UpdateRule(Method("and_mask", "AND-mask", (
            Hyperparameter("and_mask_tau", 1.0, "AND-mask's agreement threshold", "[0, 1]",
                           uniform(0.5, 1)),
        ), "mean of the domain gradients where their signs agree, rescaled",
            "DomainBed (Parascandolo et al. 2021)",
            (84.4, 78.1, 65.6, 44.6, 37.2, 62.0, "SAGM paper")), "procedure"),
        UpdateRule(Method("mldg", "MLDG", (
            Hyperparameter("mldg_beta", 1.0, "weight of the meta-test gradient", ">= 0",
                           log_uniform(-1, 1)),
            Hyperparameter("mldg_n_meta_test", 2, "meta-test domains per step", "int >= 1",
                           choice((1, 2))),
        ), "first-order meta-learning: gradient at w plus the meta-test gradient after "
           "one inner Adam step", "DomainBed (Li et al. 2018)",
            (84.9, 77.2, 66.8, 47.7, 41.2, 63.6, "DomainBed")), "procedure"),
    )
}

# The update rules that perturb the weights, on which DISAM acts.
HEADS = tuple(name for name, rule in UPDATE_RULES.items() if rule.kind == "head")
PROCEDURES = tuple(name for name, rule in UPDATE_RULES.items() if rule.kind == "procedure")

DISAM = Hyperparameter(
    "disam_lambda", 0.0,
    "DISAM: weight of the domain-loss variance in the ascent step (0 = off; sam, gsam, sagm)",
    ">= 0",
)
DISAM_PUBLISHED = {
    "DISAM on SAGM": (87.5, 80.7, 71.0, 50.0, 46.0, 67.0, "DISAM paper"),
    "DISAM on SAGM + CORAL": (88.4, 81.2, 71.7, 51.7, 46.3, 67.9, "DISAM paper"),
}


def hyperparameters() -> tuple[Hyperparameter, ...]:
    """Every method hyperparameter once (CORAL and MMD share ``mmd_gamma``), objectives
    first, then the update rules', then DISAM's: the config's "method" fields."""
    seen, result = set(), []
    methods = [*OBJECTIVES.values(), *(rule.method for rule in UPDATE_RULES.values())]
    for hp in [h for m in methods for h in m.hyperparameters] + [DISAM]:
        if hp.key not in seen:
            seen.add(hp.key)
            result.append(hp)
    return tuple(result)


def owners(key: str) -> tuple[str, ...]:
    """The objectives and update rules that use hyperparameter ``key`` (empty for shared
    settings such as ``lr``)."""
    methods = [*OBJECTIVES.values(), *(rule.method for rule in UPDATE_RULES.values())]
    return tuple(m.name for m in methods if any(h.key == key for h in m.hyperparameters))


def combination_problem(objective: str, algorithm: str, disam_lambda: float) -> str | None:
    """Why ``objective`` x ``algorithm`` (x DISAM) is not a method, or None.

    Objectives compose with every plain and sharpness-aware rule: the head receives the
    objective's gradient at w and at the perturbed point. The procedures define their
    own per-domain losses (plain cross-entropy of each domain, as DomainBed's), so they
    take the ``erm`` objective only. DISAM changes the ascent step of a head; ``erm`` and
    the procedures have none."""
    if algorithm in PROCEDURES and objective != "erm":
        return (
            f"config.algorithm={algorithm} with config.objective={objective}: {algorithm} is "
            "its own update from each domain's cross-entropy (DomainBed's), so it takes "
            "objective erm only; use --config.objective=erm, or an update rule among "
            f"{', '.join(n for n in UPDATE_RULES if n not in PROCEDURES)}."
        )
    if disam_lambda and algorithm not in ("sam", "gsam", "sagm"):
        return (
            f"config.disam_lambda={disam_lambda:g} with config.algorithm={algorithm}: DISAM "
            "changes the ascent step of sam, gsam or sagm; set --config.disam_lambda=0 or "
            "choose one of them."
        )
    return None


def method_label(objective: str, algorithm: str, disam_lambda: float = 0.0) -> str:
    """The tables' name of a run's method: the update rule, ``+ <objective>`` unless it
    is ERM's, DISAM's prefix: "SAGM", "ERM + Mixup", "SAGM + CORAL", "DISAM on SAGM"."""
    rule = UPDATE_RULES[algorithm].method.label
    label = rule if objective == "erm" else f"{rule} + {OBJECTIVES[objective].label}"
    if objective != "erm" and algorithm == "erm":
        label = OBJECTIVES[objective].label if objective in _DOMAINBED_NAMES else label
    return f"DISAM on {label}" if disam_lambda else label


# DomainBed's algorithms whose row is the objective's own name (their ERM update is
# implied): "CORAL", not "ERM + CORAL". Mixup and CutMix keep "ERM + ", as the paper's
# Table 2 prints them.
_DOMAINBED_NAMES = ("coral", "mmd", "groupdro", "irm", "vrex")


def markdown_table() -> str:
    """The README's table of methods, built from the two tables (a test checks that the
    README holds exactly this): each objective and update rule with its flag, own
    hyperparameters (default; DomainBed's random distribution), source and published
    test-domain accuracy (PACS, VLCS, OfficeHome, TerraIncognita, DomainNet, average)."""
    rows = [
        "| method | flag | own hyperparameters: default (DomainBed's draw) | source "
        "| published: PACS / VLCS / OfficeHome / TerraInc / DomainNet / avg |",
        "|---|---|---|---|---|",
    ]

    def row(method: Method, flag: str) -> str:
        own = "; ".join(
            f"`{h.key}` {h.default:g}" + (f" ({h.distribution.text})" if h.distribution else "")
            for h in method.hyperparameters
        )
        published = (
            " / ".join(f"{v:.1f}" for v in method.published[:6]) + f" ({method.published[6]})"
            if method.published
            else "-"
        )
        return f"| {method.label} | `{flag}` | {own or '-'} | {method.source} | {published} |"

    rows += [row(m, f"objective={name}") for name, m in OBJECTIVES.items()]
    rows += [row(r.method, f"algorithm={name}") for name, r in UPDATE_RULES.items()]
    disam = Method("DISAM", "DISAM", (DISAM,), "", "Zhang et al. 2024 (on sam, gsam, sagm)")
    rows.append(row(disam, "disam_lambda"))
    rows += [
        f"| {label} | | | DISAM paper | "
        + " / ".join(f"{v:.1f}" for v in numbers[:6]) + f" ({numbers[6]}) |"
        for label, numbers in DISAM_PUBLISHED.items()
    ]
    return "\n".join(rows)
