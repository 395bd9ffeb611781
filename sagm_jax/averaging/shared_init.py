"""A run that starts from another run's weights: DiWA's shared initialisation and Model
Ratatouille's auxiliary featurizers.

Weight averaging across runs needs runs that share their start: averaged weights stay
in one basin only when the runs were fine-tuned from the same weights (DiWA, Ramé et
al. 2022; model soups). Two config fields say where a run starts, both read here when
the run is opened (``training.train.open_run``), so a single run, a packed run and a
population start the same way:

* ``init_from`` (``init_weights``: last / best / swad / moving_average): every network
  variable (featurizer, classifier, BatchNorm statistics) from a finished run on the
  SAME data: its dataset, data fingerprint and held-out environments must equal this
  run's. alexrame/diwa ``domainbed/algorithms.py`` ``ERM.__init__`` loads
  ``path_for_init`` (the whole ``network``) the same way; its ``--init_step`` run (the
  linear probe, ``linear_steps``) saves that file from its last weights.
* ``init_featurizer_from``: every network variable but the classifier from a finished
  run on ANOTHER dataset (facebookresearch/ModelRatatouille: the auxiliary runs'
  featurizers initialise the target runs; their classifiers, of another label set,
  never). A run on this run's own data is refused: its features would have seen the
  held-out domain (Ratatouille discards auxiliary runs of the target dataset).
  Applied after ``init_from``: the classifier stays the one ``init_from`` gave (the
  target's linear probe) or the fresh one.

A method's own modules (``methods.networks.OWN``: MIRO's encoders, a discriminator)
start fresh, as the reference's algorithms build them. The parent's variables must have
this run's network's structure and shapes (an error names the first key that differs).
Each start is recorded in ``run_info.json`` (``init``, ``init_featurizer``): the
parent's path, which weights, their step, and a SHA-256 of them
(``checkpoints.weights_sha256``, as a soup fingerprints its members), so a
population's members can be checked to share one start.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import traverse_util

from sagm_jax.data.splits import fingerprint_changes
from sagm_jax.methods import networks
from sagm_jax.training import rundir as rundir_lib
from sagm_jax.training.checkpoints import weights_sha256

# Which of a parent's weights a run starts from (config.init_weights) -> load_run's name.
INIT_WEIGHTS = {"last": "latest", "best": "best", "swad": "swad",
                "moving_average": "moving_average"}
CLASSIFIER = "classifier"  # the network's classifier (DomainBed's linear head)


def _finished_parent(path: str, key: str) -> tuple[dict, dict]:
    """The parent run's config and run_info; an error naming ``key`` when ``path`` is not
    a finished run directory."""
    if not os.path.isfile(os.path.join(path, rundir_lib.CONFIG)):
        raise ValueError(f"config.{key}={path!r}: not a run directory (no config.json there).")
    if not os.path.exists(os.path.join(path, rundir_lib.DONE)):
        raise ValueError(
            f"config.{key}={path!r}: that run has not finished (no 'done' file); train it "
            "to the end first, so that every run starting from it starts from the same weights."
        )
    return rundir_lib.read_config(path), rundir_lib.read_run_info(path)


def parent_variables(path: str, which: str, key: str = "init_from") -> tuple[dict, dict]:
    """``(variables, record)`` of a finished run's ``which`` weights (:data:`INIT_WEIGHTS`):
    the network's variables only (a method's own modules dropped)."""
    from sagm_jax.training.loading import load_run

    if which not in INIT_WEIGHTS:
        raise ValueError(f"config.init_weights={which!r}: expected one of {', '.join(INIT_WEIGHTS)}.")
    _finished_parent(path, key)
    _, variables, record = load_run(path, INIT_WEIGHTS[which])
    network, _ = networks.split_variables(dict(variables))
    return network, record or {}


def _recorded(dataset) -> dict:
    """The dataset's fingerprint as run_info.json records it (JSON's keys are strings)."""
    return json.loads(json.dumps(dataset.fingerprint, default=str))


def _check_same_data(config, dataset, parent_config: dict, parent_info: dict, path: str):
    problems = []
    if parent_config.get("dataset") != config.dataset:
        problems.append(f"dataset {parent_config.get('dataset')!r}, not {config.dataset!r}")
    elif changes := fingerprint_changes(parent_info.get("fingerprint") or {}, _recorded(dataset)):
        problems.append("other data (its run_info.json's data fingerprint differs from this "
                        f"data's: {'; '.join(changes[:3])})")
    if sorted(parent_config.get("test_envs", ())) != sorted(config.test_envs):
        problems.append(
            f"held-out environments {tuple(parent_config.get('test_envs', ()))}, not "
            f"{tuple(config.test_envs)} (a shared start trained on a held-out domain leaks it)"
        )
    if problems:
        raise ValueError(f"config.init_from={path!r}: that run has " + "; ".join(problems) + ".")


def _check_other_data(config, dataset, parent_config: dict, parent_info: dict, path: str):
    same_name = parent_config.get("dataset") == config.dataset
    if not fingerprint_changes(parent_info.get("fingerprint") or {}, _recorded(dataset)) or (
        same_name and config.dataset != "ImageFolder"
    ):
        raise ValueError(
            f"config.init_featurizer_from={path!r}: that run trained on this run's dataset "
            f"({config.dataset}); an auxiliary featurizer must come from another dataset, or "
            "it has seen the held-out domain (Model Ratatouille discards such runs). Use "
            "config.init_from for a start on the same data."
        )


def _replaced(own: dict, parent: dict, path: str, key: str, keep=()) -> dict:
    """``own`` with every leaf of ``parent`` (same structure and shapes required) but the
    top-level parameter groups in ``keep``."""
    flat, theirs = traverse_util.flatten_dict(own), traverse_util.flatten_dict(parent)
    wanted = {k for k in flat if not (k[0] == "params" and k[1] in keep)}
    offered = {k for k in theirs if not (k[0] == "params" and k[1] in keep)}
    for k in sorted(wanted ^ offered):
        where = "this run's network" if k in wanted else f"{path}'s"
        raise ValueError(
            f"config.{key}={path!r}: '{'/'.join(k)}' is only in {where} variables; the runs "
            "must share one network (the same config.arch and its options)."
        )
    for k in sorted(wanted):
        if np.shape(flat[k]) != np.shape(theirs[k]):
            raise ValueError(
                f"config.{key}={path!r}: '{'/'.join(k)}' has shape {np.shape(theirs[k])} "
                f"there, {np.shape(flat[k])} in this run's network (another config.arch or "
                "options)."
            )
        flat[k] = np.asarray(theirs[k], np.asarray(flat[k]).dtype)
    return traverse_util.unflatten_dict(flat)


def _start(config, dataset, network: dict, key: str, which: str, keep=()) -> tuple[dict, dict]:
    path = os.path.abspath(getattr(config, key))
    parent_config, parent_info = _finished_parent(path, key)
    if key == "init_from":
        _check_same_data(config, dataset, parent_config, parent_info, path)
    else:
        _check_other_data(config, dataset, parent_config, parent_info, path)
    parent, record = parent_variables(path, which, key)
    if key == "init_featurizer_from":
        parent = {c: {k: v for k, v in tree.items() if k != CLASSIFIER} if c == "params" else tree
                  for c, tree in parent.items()}
    started = _replaced(network, parent, path, key, keep)
    info = {"from": path, "weights": which, "step": record.get("step"),
            "dataset": parent_config.get("dataset"), "sha256": weights_sha256(parent)}
    return started, info


def initial_variables(config, variables: dict, dataset) -> tuple[dict, dict]:
    """The run's step-0 variables: ``variables`` (freshly built) with the parents'
    weights of ``config.init_from`` and ``config.init_featurizer_from`` (module
    docstring); and the ``run_info.json`` entries that record them."""
    info = {}
    if not (config.get("init_from") or config.get("init_featurizer_from")):
        return variables, info
    network, own = networks.split_variables(dict(variables))
    if config.init_from:
        network, info["init"] = _start(config, dataset, network, "init_from", config.init_weights)
    if config.init_featurizer_from:
        network, info["init_featurizer"] = _start(
            config, dataset, network, "init_featurizer_from", "last", keep=(CLASSIFIER,)
        )
    return networks.with_method_variables(network, own), info
