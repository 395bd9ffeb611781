"""The two registries of methods: objectives and update rules.

A run is ``objective x update rule (+ DISAM)``:

* an OBJECTIVE (``config.objective``, :data:`OBJECTIVES`) is the loss one step minimises
  from the per-domain minibatches (``sagm_jax.methods.objectives`` registers them);
* an UPDATE RULE (``config.algorithm``, :data:`UPDATE_RULES`) turns that loss into an
  update: plain Adam (``erm``), a sharpness-aware optax head before Adam (``sam``,
  ``gsam``, ``sagm``, ``erm_sam``; ``sagm_jax.methods.update_rules``), or a procedure that
  is its own update (``fish``, ``and_mask``, ``mldg``; ``sagm_jax.methods.procedures``);
* DISAM (``config.disam_lambda`` > 0) replaces the ascent gradient of a head by the
  domain-variance one (``sagm_jax.methods.update_rules``; docs/methods.md, "DISAM").

Each entry holds its builder (the loss, or the update rule's transforms or procedure),
its label (the tables' row), its own hyperparameters (config key, default, meaning,
bounds, DomainBed's random distribution where it has one), its source, the published
numbers and what it composes with. Adding a method is one function and one
:func:`register_objective` or :func:`register_update_rule` call (docs/methods.md,
"Adding a method"): the config fields and their checks, the sweep's choices and random
search, the tables' labels and the README's table read the registries.

The checks of a value against a hyperparameter's bounds (:func:`bounds` and the generic
number, integer and name checks it builds on) live here too: the config checks its
fields with them and the optax transforms their arguments, which import nothing of the
package but this module.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, NamedTuple, Sequence

import numpy as np

# ----------------------------------------------------------------------------
# The checks of a value against bounds as the registry writes them (``Hyperparameter
# .bounds``): ``check(value, config, device_count) -> None``, or what was expected. The
# config checks its fields with them (``sagm_jax.config.checks``) and the optax
# transforms their arguments (``sagm_jax.methods.update_rules``), which import nothing
# of the package but this module.
ValueCheck = Callable[[object, object, "int | None"], "str | None"]

# rho's bound. The published radii are 0.01-0.1 (SAM, GSAM, SAGM) and up to 2 for
# ASAM's scaled perturbation; far above them the perturbed point says nothing of the
# loss near the weights (rho=1e9 trains to chance), so it is an error, not a warning.
RHO_MAX = 10.0


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(at_least: int, why: str = "", at_most: int | None = None) -> ValueCheck:
    def check(value, config, device_count):
        if not (is_int(value) and value >= at_least):
            return ("a positive integer" if at_least == 1 else f"an integer >= {at_least}") + why
        if at_most is not None and value > at_most:
            return f"an integer <= {at_most}" + why

    return check


def number(interval: str, why: str = "") -> ValueCheck:
    """A finite number in ``interval``, written as the message shows it: ``"> 0"``,
    ``">= 0"``, or bounds such as ``"(0, 1)"``, ``"[0, 1)"``, ``"[0, 1]"``."""
    if interval.startswith(">"):
        sign, bound = interval.split()
        low, high, text = float(bound), math.inf, interval
        lower, upper = (operator.ge if sign == ">=" else operator.gt), operator.le
    else:
        low, high = (float(bound) for bound in interval[1:-1].split(","))
        lower = operator.gt if interval[0] == "(" else operator.ge
        upper = operator.lt if interval[-1] == ")" else operator.le
        text = f"in {interval}"

    def check(value, config, device_count):
        if not (is_number(value) and lower(value, low) and upper(value, high)):
            return f"a number {text}{why}"

    return check


def kind(kind: type, text: str) -> ValueCheck:
    def check(value, config, device_count):
        if not isinstance(value, kind):
            return text

    return check


@dataclasses.dataclass(frozen=True)
class OneOf:
    """The check of a field that names one of ``names`` (a registry's, where one exists)."""

    names: Sequence[str]
    note: str = ""  # follows the names in the message (why a name is left out)

    def __call__(self, value, config, device_count):
        if not isinstance(value, str) or value not in self.names:
            return f"one of {', '.join(self.names)}{self.note}"


def bounds(bounds: str, note: str = "") -> ValueCheck:
    """The check of a method hyperparameter's bounds as ``sagm_jax.methods`` writes them:
    ``"int >= k"``, ``"one of a, b"``, ``"bool"`` (True or False) or an interval of
    :func:`number`; ``note`` follows the expected value in the message."""
    if bounds == "bool":
        return kind(bool, "True or False" + note)
    if bounds.startswith("int >= "):
        return integer(int(bounds.split()[-1]), note)
    if bounds.startswith("one of "):
        return OneOf(tuple(bounds[len("one of ") :].split(", ")), note)
    return number(bounds, note)


class Distribution(NamedTuple):
    """DomainBed's random draw of one hyperparameter: ``draw(numpy RandomState)``."""

    text: str
    draw: Callable[[np.random.RandomState], object]


def log_uniform(low: float, high: float, integer: bool = False, base: int = 10) -> Distribution:
    """``base ** U(low, high)`` (``int(...)`` when ``integer``), as DomainBed writes it
    (base 2 for DANN's discriminator width and steps)."""

    def draw(rng):
        value = base ** rng.uniform(low, high)
        return int(value) if integer else float(value)

    text = f"{base}^U({low:g},{high:g})"
    return Distribution(f"int({text})" if integer else text, draw)


def uniform(low: float, high: float) -> Distribution:
    return Distribution(f"U({low:g},{high:g})", lambda rng: float(rng.uniform(low, high)))


def fixed(value) -> Distribution:
    """Always ``value`` (a hyperparameter the search keeps at its default)."""
    return Distribution(f"{value:g}", lambda rng: value)


def choice(values: tuple) -> Distribution:
    """One of ``values`` (numbers or names, URM's activations), equally likely."""
    text = "{" + ", ".join(_text(v) for v in values) + "}"
    return Distribution(text, lambda rng: values[rng.choice(len(values))])


class Hyperparameter(NamedTuple):
    """One hyperparameter of a method: its config key, default, meaning, bounds (an
    interval as ``sagm_jax.config`` writes it: ``"> 0"``, ``">= 0"``, ``"[0, 1]"``,
    ``"int >= 1"``, ``"one of mean, sum"``, or ``"bool"``), DomainBed's random distribution (None
    where it has none) and a note the config's error adds after the bounds."""

    key: str
    default: object
    meaning: str
    bounds: str
    distribution: Distribution | None = None
    note: str = ""


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
    # ``by_dataset(dataset, mnist_like) -> {config key: (default, Distribution)}``: the
    # defaults and draws DomainBed's ``hparams_registry`` gives this method on ``dataset``
    # where they differ from the registry's (RDM's rdm_lambda, ADRMX's lr; shared keys
    # such as ``lr`` and ``batch_per_env`` included); None where none differs.
    by_dataset: Callable[[str, bool], dict] | None = None


class Objective(NamedTuple):
    """One objective: its description and the loss one step minimises.

    ``loss(step) -> (loss, objectives.Aux)`` reads a ``sagm_jax.methods.objectives.Step``
    (the batch, a ``forward`` to call once, the hyperparameters with their defaults
    filled in, the state, the step counter and a PRNG key)."""

    method: Method
    loss: Callable
    # ``init_state(num_domains) -> dict``, the state before step 0 (GroupDRO's q); None
    # for an objective without state.
    init_state: Callable[[int], dict] | None = None
    # The hyperparameter whose value is the step before which a fresh optimizer replaces
    # the old one (IRM's and VREx's anneal length), a tuple of them for several restarts
    # (IB_IRM's two anneals); None for no restart.
    restart_key: str | tuple[str, ...] | None = None
    # A DomainBed algorithm whose row is its own name under ERM ("CORAL", not
    # "ERM + CORAL"); Mixup and CutMix keep "ERM + ", as the paper's Table 2 prints them.
    label_alone: bool = False
    # The fewest examples per training domain and step the loss is defined for, and why
    # (the config refuses fewer before a run): CORAL's unbiased covariance, IRM's halves.
    min_batch_per_env: int = 1
    min_batch_reason: str = ""
    # The modules the method trains beside the network and its own prediction
    # (``sagm_jax.methods.networks.MethodNetwork``); None for a loss of the network alone.
    network: object = None
    # The hyperparameter whose value is the learning rate of the fresh optimizer of a
    # ``restart_key`` restart (EQRM's eqrm_lr), kept from then on; None keeps ``lr``.
    restart_lr_key: str | None = None
    # The fewest training domains the loss is defined for, and why (the config refuses
    # fewer before a run where the dataset's domains are known): EQRM's bandwidth.
    min_train_domains: int = 1
    min_domains_reason: str = ""

    @property
    def name(self) -> str:
        return self.method.name


KINDS = ("plain", "head", "procedure")


class UpdateRule(NamedTuple):
    """One update rule: its description, kind and builder.

    * ``kind="plain"`` or ``"head"``: ``build(hp, *, adaptive, perturbation, axis_name,
      disam_descent) -> list of optax transforms``, placed before the paper's Adam by
      ``update_rules.rule_optimizer`` (a head is a sharpness-aware transform that takes
      ``grad_fn``; ``plain`` uses the clean gradient only).
    * ``kind="procedure"``: ``build(hp, *, learning_rate, weight_decay, num_domains) ->
      procedures.Procedure``, its own update from per-domain gradients, or from passes
      over the whole batch (``Procedure.whole_batch``) with modules of its own
      (``network``).

    ``hp`` holds the rule's own hyperparameters (``method.hyperparameters``), defaults
    filled in."""

    method: Method
    kind: str
    build: Callable
    # Takes DISAM's ascent gradient (``ascent_grads``): sam, gsam, sagm.
    disam: bool = False
    # MixStyle restyles the clean pass too (SAGM's released code runs its clean pass
    # without MixStyle: False for sagm).
    clean_pass_mixstyle: bool = True
    # A procedure's own modules (DANN's discriminator, SagNet's style network):
    # ``sagm_jax.methods.networks.MethodNetwork``, as ``Objective.network``; None for none.
    network: object = None

    @property
    def name(self) -> str:
        return self.method.name


# The two registries, filled by the modules that own the code (``objectives``,
# ``update_rules``, ``procedures``) when ``sagm_jax.methods`` is imported, in the order
# the tables and the README list them.
OBJECTIVES: dict[str, Objective] = {}
UPDATE_RULES: dict[str, UpdateRule] = {}


def register_objective(objective: Objective) -> Objective:
    """Adds ``objective`` to :data:`OBJECTIVES`; the config (``--config.objective`` and
    its hyperparameters' fields), the checks, the sweep and the tables read it from
    there. Returns it."""
    _check_new(objective.method, OBJECTIVES, "objective")
    OBJECTIVES[objective.name] = objective
    return objective


def register_update_rule(rule: UpdateRule) -> UpdateRule:
    """Adds ``rule`` (plain, head or procedure) to :data:`UPDATE_RULES`, as
    :func:`register_objective` does for objectives. Returns it."""
    if rule.kind not in KINDS:
        raise ValueError(f"update rule {rule.name!r}: kind={rule.kind!r}, expected one of "
                         f"{', '.join(KINDS)}.")
    _check_new(rule.method, UPDATE_RULES, "update rule")
    UPDATE_RULES[rule.name] = rule
    return rule


def _check_new(method: Method, table: dict, what: str) -> None:
    """A new entry's name is a free lowercase identifier; a hyperparameter key that
    another method declares is the same hyperparameter (same default and bounds)."""
    if not (method.name.isidentifier() and method.name == method.name.lower()):
        raise ValueError(f"{what} {method.name!r}: expected a lowercase Python identifier "
                         "(it is a config value and a command-line word).")
    if method.name in table:
        raise ValueError(f"{what} {method.name!r} is registered already.")
    declared = {h.key: h for h in hyperparameters()}
    for hp in method.hyperparameters:
        other = declared.get(hp.key)
        if other is not None and (other.default, other.bounds) != (hp.default, hp.bounds):
            raise ValueError(
                f"{what} {method.name!r}: hyperparameter {hp.key!r} (default {hp.default!r}, "
                f"bounds {hp.bounds!r}) differs from the one {', '.join(owners(hp.key))} "
                f"declare (default {other.default!r}, bounds {other.bounds!r}); give it "
                "another key."
            )


def objective(name: str) -> Objective:
    """The entry of objective ``name``, or a ValueError that lists the registered ones."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def update_rule(name: str) -> UpdateRule:
    """The entry of update rule ``name``, or a ValueError that lists the registered ones."""
    if name not in UPDATE_RULES:
        raise ValueError(
            f"unknown update rule {name!r}; choose one of {', '.join(UPDATE_RULES)}"
        )
    return UPDATE_RULES[name]


def rule_names(kind: str) -> tuple[str, ...]:
    """The registered update rules of ``kind`` ("plain", "head", "procedure")."""
    return tuple(name for name, rule in UPDATE_RULES.items() if rule.kind == kind)


def settings(method: Method, hp) -> dict:
    """``{key: hp[key]}`` for each of ``method``'s hyperparameters, the registry's default
    where ``hp`` lacks the key (other keys of ``hp`` are left out)."""
    return {h.key: hp.get(h.key, h.default) for h in method.hyperparameters}


# DISAM is not an entry: it modifies the ascent step of the heads that take it
# (``UpdateRule.disam``).
DISAM = Hyperparameter(
    "disam_lambda", 0.0,
    "DISAM: weight of the domain-loss variance in the ascent step (0 = off; sam, gsam, sagm)",
    ">= 0",
)
DISAM_PUBLISHED = {
    "DISAM on SAGM": (87.5, 80.7, 71.0, 50.0, 46.0, 67.0, "DISAM paper"),
    "DISAM on SAGM + CORAL": (88.4, 81.2, 71.7, 51.7, 46.3, 67.9, "DISAM paper"),
}
# Published rows with SWAD (the tables' "<method> + SWAD"); None where the source prints
# no per-dataset figure (MIRO's README states the average in its text, the rest in an
# image).
SWAD_PUBLISHED = {
    "ERM + SWAD": (88.1, 79.1, 70.6, 50.0, 46.5, 66.9, "SWAD paper"),
    "CORAL + SWAD": (88.3, 78.9, 71.3, 51.0, 46.8, 67.3, "SWAD paper"),
    "MIRO + SWAD": (None, None, None, None, None, 68.1, "MIRO README"),
}
# Published rows of the averagings across runs (``AVERAGINGS``' labels, ERM members,
# ResNet-50), each the variant its source names. DiWA's README (alexrame/diwa), "LP" init
# rows: "Uniform" and "Restricted" (the greedy soup) average the 20 runs of one data split
# (trial seed), the figure being the mean over 3 splits; "DiWA† Uniform" averages the 60
# runs of the 3 splits (our "(uniform, 3 splits)" rows). Model Ratatouille's README
# (facebookresearch/ModelRatatouille): "Uniform", "Greedy" and "Uniform†" likewise. EoA's
# README prints its table as an image and the ERM++ README (piotr-teterwak/erm_plusplus)
# and DomainBed's print none: their rows name the paper, with no figure.
AVERAGING_PUBLISHED = {
    "DiWA (uniform)": (88.7, 78.4, 72.1, 51.4, 47.4, 67.6, "DiWA README, uniform, LP init"),
    "DiWA (greedy)": (88.0, 78.5, 71.5, 51.6, 47.7, 67.5, "DiWA README, restricted, LP init"),
    "DiWA (uniform, 3 splits)": (89.0, 78.6, 72.8, 51.9, 47.7, 68.0,
                                 "DiWA README, DiWA† uniform, LP init"),
    "Ratatouille (uniform)": (89.5, 78.5, 73.1, 51.8, 47.5, 68.1, "Ratatouille README, uniform"),
    "Ratatouille (greedy)": (90.5, 78.7, 73.4, 49.2, 47.7, 67.9, "Ratatouille README, greedy"),
    "Ratatouille (uniform, 3 splits)": (89.8, 78.3, 73.5, 52.0, 47.7, 68.3,
                                        "Ratatouille README, uniform†"),
    "EoA": (None,) * 6 + ("EoA paper; its README's table is an image",),
    "ERM++": (None,) * 6 + ("ERM++ paper; no README prints its figures",),
}


def published() -> dict[str, tuple]:
    """Every published row by its tables' name (``method_label``, "+ SWAD" rows as the
    tables name them, ``averaging_label``): the registered methods' numbers, DISAM's,
    SWAD's and the averagings' rows."""
    rows = {method_label(o, "erm"): entry.method.published for o, entry in OBJECTIVES.items()}
    rows.update({method_label("erm", r): rule.method.published
                 for r, rule in UPDATE_RULES.items()})
    rows.update(DISAM_PUBLISHED)
    rows.update(SWAD_PUBLISHED)
    rows.update(AVERAGING_PUBLISHED)
    return {label: numbers for label, numbers in rows.items() if numbers}


def published_text(numbers: tuple, average_only: bool = False) -> str:
    """``"85.5 / 77.3 / ... / 63.9 (source)"`` ("-" for a figure the source does not
    print); only the average and source with ``average_only``; "-" for no numbers."""
    if not numbers:
        return "-"
    figures = numbers[5:6] if average_only else numbers[:6]
    text = " / ".join("-" if v is None else f"{v:.1f}" for v in figures)
    return f"{text} ({numbers[6]})"


def hyperparameters() -> tuple[Hyperparameter, ...]:
    """Every method hyperparameter once (CORAL and MMD share ``mmd_gamma``), objectives
    first, then the update rules', then DISAM's: the config's "method" fields."""
    seen, result = set(), []
    for hp in [h for m in _methods() for h in m.hyperparameters] + [DISAM]:
        if hp.key not in seen:
            seen.add(hp.key)
            result.append(hp)
    return tuple(result)


def owners(key: str) -> tuple[str, ...]:
    """The objectives and update rules that use hyperparameter ``key`` (empty for shared
    settings such as ``lr``)."""
    return tuple(m.name for m in _methods() if any(h.key == key for h in m.hyperparameters))


def _methods() -> list[Method]:
    return [*(o.method for o in OBJECTIVES.values()), *(r.method for r in UPDATE_RULES.values())]


def combination_problem(objective: str, algorithm: str, disam_lambda: float) -> str | None:
    """Why ``objective`` x ``algorithm`` (x DISAM) is not a method, or None.

    Objectives compose with every plain and sharpness-aware rule: the head receives the
    objective's gradient at w and at the perturbed point. The procedures define their
    own per-domain losses (plain cross-entropy of each domain, as DomainBed's), so they
    take the ``erm`` objective only (DANN, CDANN, SagNet and mDSDI likewise compute their
    own losses over the whole batch). DISAM changes the ascent step of a head; ``erm`` and
    the procedures have none."""
    if UPDATE_RULES[algorithm].kind == "procedure" and objective != "erm":
        return (
            f"config.algorithm={algorithm} with config.objective={objective}: {algorithm} is "
            "its own update from its own losses (DomainBed's), so it takes objective erm "
            "only; use --config.objective=erm, or an update rule among "
            f"{', '.join(rule_names('plain') + rule_names('head'))}."
        )
    if disam_lambda and not UPDATE_RULES[algorithm].disam:
        *others, last = [n for n, rule in UPDATE_RULES.items() if rule.disam]
        takers = f"{', '.join(others)} or {last}" if others else last
        return (
            f"config.disam_lambda={disam_lambda:g} with config.algorithm={algorithm}: DISAM "
            f"changes the ascent step of {takers}; set --config.disam_lambda=0 or "
            "choose one of them."
        )
    return None


def method_label(objective: str, algorithm: str, disam_lambda: float = 0.0) -> str:
    """The tables' name of a run's method: the update rule, ``+ <objective>`` unless it
    is ERM's, DISAM's prefix: "SAGM", "ERM + Mixup", "SAGM + CORAL", "DISAM on SAGM"."""
    rule, entry = UPDATE_RULES[algorithm].method.label, OBJECTIVES[objective]
    label = rule if objective == "erm" else f"{rule} + {entry.method.label}"
    if objective != "erm" and algorithm == "erm" and entry.label_alone:
        label = entry.method.label
    return f"DISAM on {label}" if disam_lambda else label


# The averagings across runs (``sagm_jax.averaging``) by name, each with its tables' label:
# DiWA's uniform and greedy soups (alexrame/diwa), Model Ratatouille's (DiWA's averaging of
# runs started from auxiliary fine-tunings; facebookresearch/ModelRatatouille), EoA's
# ensemble of moving averages (salesforce/ensemble-of-averages) and ERM++ (DomainBed's
# ``ERMPlusPlus`` with its training script ``train_autolr.py``).
AVERAGINGS = {
    "diwa_uniform": "DiWA (uniform)",
    "diwa_greedy": "DiWA (greedy)",
    "ratatouille_uniform": "Ratatouille (uniform)",
    "ratatouille_greedy": "Ratatouille (greedy)",
    "eoa": "EoA",
    "erm_plusplus": "ERM++",
}


def averaging_label(member_label: str, averaging: str) -> str:
    """The tables' row of an averaging across runs of ``member_label`` runs (their
    ``method_label``, with " + SWAD" where the members' SWAD weights are averaged):
    ``averaging`` alone for ERM's members ("DiWA (uniform)", "EoA", "ERM++"), else
    "<member label> + <averaging>" ("SAGM + DiWA (uniform)", "SAGM + CORAL + EoA").
    ``averaging`` is a name of :data:`AVERAGINGS` ("diwa_greedy") or its label
    ("DiWA (greedy)")."""
    label = AVERAGINGS.get(averaging, averaging)
    if label not in AVERAGINGS.values():
        raise ValueError(
            f"averaging {averaging!r}: expected one of {', '.join(AVERAGINGS)} or its label "
            f"({', '.join(AVERAGINGS.values())})."
        )
    if not (isinstance(member_label, str) and member_label):
        raise ValueError(f"member label {member_label!r}: expected a method's label such as "
                         "'SAGM' (methods.method_label).")
    return label if member_label == method_label("erm", "erm") else f"{member_label} + {label}"


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
            f"`{h.key}` {_text(h.default)}"
            + (f" ({h.distribution.text})" if h.distribution else "")
            for h in method.hyperparameters
        )
        return (f"| {method.label} | `{flag}` | {own or '-'} | {method.source} | "
                f"{published_text(method.published)} |")

    rows += [row(o.method, f"objective={name}") for name, o in OBJECTIVES.items()]
    rows.append(  # a network option (sagm_jax.models.mixstyle), not a registry entry
        "| ERM + MixStyle | `mixstyle=True` | `mixstyle_p` 0.5; `mixstyle_alpha` 0.1; "
        "`mixstyle_mix` random (crossdomain: Mixstyle2) | Zhou et al. 2021 (SWAD repository); "
        "SAGM repository (Mixstyle2) | - |"
    )
    rows += [row(r.method, f"algorithm={name}") for name, r in UPDATE_RULES.items()]
    disam = Method("DISAM", "DISAM", (DISAM,), "", "Zhang et al. 2024 (on sam, gsam, sagm)")
    rows.append(row(disam, "disam_lambda"))
    rows += [f"| {label} | | | {numbers[6]} | {published_text(numbers)} |"
             for label, numbers in {**DISAM_PUBLISHED, **SWAD_PUBLISHED,
                                    **AVERAGING_PUBLISHED}.items()]
    return "\n".join(rows)


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value)
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)
