"""Populations: M runs from one shared start, trained as packed programs, then averaged.

    python -m sagm_jax.averaging.population --config=configs/rotated_digits.py \\
        --workdir DIR [--recipe diwa|eoa|ratatouille] [--members 8] [--pack 8] \\
        [--space diwa|domainbed|eoa] [--keep KEY,...] [--linear_probe_steps N] \\
        [--aux_runs ROOT,...] [--config.key=value ...]

The recipes, each as its reference runs it (docs/averaging.md):

* ``diwa`` (alexrame/diwa README, "DiWA Procedure Details"): (1) the shared start,
  ``DIR/init``: the config's network with only its classifier trained for
  ``--linear_probe_steps`` steps (ERM, the default hyperparameters, ``linear_steps``: the
  reference's ``--init_step`` run, whose last weights it saves); (2) the members
  ``DIR/members/member<k>``, k = 1..M: the config's method (SAGM, SAGM + CORAL, MIRO, any)
  with setting ``hparams_seed = k`` of the search space ``--space`` (DiWA's mild ranges,
  ``sweep.hparams.random_hparams(space="diwa")``, or DomainBed's), each starting from
  ``DIR/init``'s last weights (``init_from``), trained ``--pack`` at a time as one
  program (``training.packed``; ``--keep`` keys are not drawn: the config's value
  stays, e.g. ``batch_per_env``, which DomainBed's space draws per run and which a pack
  shares); (3) the soups of the members' best weights,
  ``DIR/soup_uniform`` and ``DIR/soup_greedy`` (``averaging.soups``).
* ``eoa`` (salesforce/ensemble-of-averages README): the members, drawn from EoA's space
  (lr 5e-5, batch 32, weight decay 10^U(-6, -4)), train from the config's own start with
  ``moving_average`` (each run's simple moving average, from
  ``moving_average_start``); their best averages are ensembled, ``DIR/ensemble``
  (``averaging.ensemble``: the sum of their logits).
* ``ratatouille`` (facebookresearch/ModelRatatouille README): as ``diwa``, and member k's
  featurizer starts from an auxiliary run on another dataset (``init_featurizer_from``),
  chosen as the reference's ``misc.get_featurizer_aux``: of the auxiliary folders
  ``--aux_runs`` (sorted; those of this dataset left out), folder ``k mod (F + 1)``,
  where 0 is none (the pretrained featurizer), and in it the finished run
  ``k mod (its runs)`` (sorted). Auxiliary runs are populations of their own on the
  other datasets with every environment trained (``--config.test_envs="()"``, the
  reference's ``--test_env -1``), e.g. ``--recipe diwa --members 4``; their
  ``DIR/members`` folders are the ``--aux_runs``.

Members share the config's ``seed`` and ``trial_seed`` (as ``sagm_jax.sweep``'s jobs do:
the same data and split; RotatedDigits' environments are shuffled by the seed) and differ
in their hyperparameters. Everything is a run directory: a relaunch of the same command
finds the finished runs done, resumes the others where their checkpoints are, and
recomputes the soups from the members' weights, so a population killed at any point
ends with the same runs and the same soups.
"""

from __future__ import annotations

import os
import sys

import ml_collections

from sagm_jax.training import rundir as rundir_lib

RECIPES = ("diwa", "eoa", "ratatouille")
# Each recipe's search space (sweep.hparams.SPACES): its reference's.
SPACE_OF = {"diwa": "diwa", "ratatouille": "diwa", "eoa": "eoa"}
# The keys a shared start resets to the reference's: the linear probe is ERM's
# (alexrame/diwa trains it with its ERM), on the default hyperparameters, without SWAD or
# a moving average.
PROBE_RESET = {"algorithm": "erm", "objective": "erm", "swad": False, "disam_lambda": 0.0,
               "mixstyle": False, "init_from": "", "init_featurizer_from": ""}


def probe_config(config, steps: int, space: str = "diwa") -> ml_collections.ConfigDict:
    """The shared start's run: ``config``'s data and network, its classifier alone trained
    for ``steps`` steps (``linear_steps``) by ERM at the default hyperparameters of
    ``space`` (setting 0: the reference's ``--init_step`` run takes its defaults)."""
    from sagm_jax.sweep.hparams import random_hparams

    probe = ml_collections.ConfigDict(config.to_dict())
    probe.update(PROBE_RESET)
    probe.moving_average = False
    probe.update(random_hparams("erm", config.dataset, 0, config.trial_seed, arch=config.arch,
                                space=space))
    probe.update(steps=steps, linear_steps=steps, hparams_seed=0)
    return probe


def member_config(config, recipe: str, k: int, space: str, start: str | None,
                  featurizer: str | None, keep: tuple[str, ...] = ()) -> ml_collections.ConfigDict:
    """Member ``k``'s config: ``config`` with setting ``hparams_seed = k`` of ``space``
    (``sweep.hparams.random_hparams``) but the keys ``keep`` (the config's values stay),
    its start and, for EoA, its moving average."""
    from sagm_jax.sweep.hparams import random_hparams

    member = ml_collections.ConfigDict(config.to_dict())
    drawn = random_hparams(config.algorithm, config.dataset, k, config.trial_seed,
                           config.objective, config.disam_lambda, config.arch, space=space)
    unknown = [key for key in keep if key not in drawn]
    if unknown:
        raise ValueError(f"--keep {','.join(unknown)}: not drawn by the search space {space!r} "
                         f"for this method (it draws {', '.join(drawn)}).")
    member.update({key: value for key, value in drawn.items() if key not in keep})
    member.hparams_seed = k
    if recipe == "eoa":
        member.moving_average = True
    else:
        member.init_from, member.init_weights = start, "last"
        member.init_featurizer_from = featurizer or ""
    return member


def auxiliary_run(roots: list[str], dataset: str, k: int) -> str | None:
    """Member ``k``'s auxiliary featurizer, as facebookresearch/ModelRatatouille
    ``domainbed/lib/misc.py`` ``get_featurizer_aux`` picks it: the folders ``roots``
    (sorted; a folder whose runs trained on ``dataset`` left out, as its
    ``_detect_folders``); ``k mod (F + 1) == 0`` is none; else that folder's finished
    runs (sorted), run ``k mod (their number)`` (``_detect_path_in_subfolder``)."""
    folders = sorted(
        os.path.abspath(root) for root in roots
        if not any(_dataset_of(run) == dataset for run in _finished_runs(root))
    )
    index = k % (len(folders) + 1)
    if index == 0:
        return None
    runs = _finished_runs(folders[index - 1])
    if not runs:
        raise ValueError(f"--aux_runs: {folders[index - 1]} holds no finished run.")
    return runs[k % len(runs)]


def _finished_runs(root: str) -> list[str]:
    if not os.path.isdir(root):
        raise ValueError(f"--aux_runs: {root} is not a directory.")
    paths = (os.path.join(root, name) for name in sorted(os.listdir(root)))
    return [p for p in paths if os.path.exists(os.path.join(p, rundir_lib.DONE))]


def _dataset_of(run: str) -> str | None:
    return rundir_lib.read_config(run).get("dataset")


def member_dirs(workdir: str, members: int) -> list[str]:
    return [os.path.join(workdir, "members", f"member{k}") for k in range(1, members + 1)]


def train_members(configs: list, workdirs: list[str], pack: int) -> None:
    """The members, ``pack`` at a time, each pack one program (``training.packed``): the
    members that can share a program (``packed.program_key``: DomainBed's space draws the
    batch size) grouped first, in their order."""
    from sagm_jax.training import packed

    groups: dict[str, list[int]] = {}
    for k, config in enumerate(configs):
        groups.setdefault(packed.program_key(config.to_dict()), []).append(k)
    for lanes in groups.values():
        for first in range(0, len(lanes), pack):
            chosen = lanes[first:first + pack]
            packed.train_pack([configs[k] for k in chosen], [workdirs[k] for k in chosen])


def run_population(config, workdir: str, recipe: str = "diwa", members: int = 8,
                   pack: int = 8, space: str | None = None,
                   linear_probe_steps: int | None = None,
                   aux_runs: tuple[str, ...] = (), keep: tuple[str, ...] = ()) -> dict:
    """Trains the population ``recipe`` (module docstring) in ``workdir`` and averages it;
    returns ``{name: record}`` of the averages (``soup_uniform``, ``soup_greedy`` or
    ``ensemble``), after printing the members' and the averages' accuracies."""
    from sagm_jax.averaging import soups
    from sagm_jax.training import train

    if recipe not in RECIPES:
        raise ValueError(f"--recipe {recipe!r}: expected one of {', '.join(RECIPES)}.")
    if recipe == "ratatouille" and not aux_runs:
        raise ValueError("--recipe ratatouille needs --aux_runs (the auxiliary runs' folders).")
    space, start = space or SPACE_OF[recipe], None
    if recipe != "eoa":
        start = os.path.abspath(os.path.join(workdir, "init"))  # as the members record it
        steps = config.steps if linear_probe_steps is None else linear_probe_steps
        train.train_one_run(probe_config(config, steps, space), start)
    dirs = member_dirs(workdir, members)
    configs = [
        member_config(config, recipe, k, space, start,
                      auxiliary_run(list(aux_runs), config.dataset, k)
                      if recipe == "ratatouille" else None, keep)
        for k in range(1, members + 1)
    ]
    train_members(configs, dirs, pack)
    weights = "swad" if config.swad else "best"
    if recipe == "eoa":
        from sagm_jax.averaging import ensemble

        makers = {"ensemble": lambda out: ensemble.make_ensemble(dirs, out)}
    else:
        makers = {
            f"soup_{selection}": lambda out, s=selection: soups.make_soup(dirs, out, s, weights)
            for selection in soups.SELECTIONS
        }
    averages = {}
    for name, make in makers.items():
        out = os.path.join(workdir, name)
        averages[name] = finished_average(out, dirs) or make(out)
    print(report(dirs, averages))
    return averages


def finished_average(out: str, dirs: list[str]) -> dict | None:
    """The record of the average already written in ``out`` by a finished launch of the
    same population (its members are ``dirs``), or None when there is none yet (a
    half-written one is written again)."""
    if not os.path.exists(os.path.join(out, rundir_lib.DONE)):
        return None
    recorded = [m["path"] for m in rundir_lib.read_run_info(out).get("members", [])]
    if recorded != [os.path.abspath(d) for d in dirs]:
        raise ValueError(f"{out} holds an average of other runs ({recorded}); delete it, or "
                         "choose another --workdir.")
    return rundir_lib.read_records(out)[-1]


def report(dirs: list[str], averages: dict) -> str:
    """The members' selected test accuracies and hyperparameters beside the averages'."""
    from sagm_jax.results.selection import training_domain_validation, validation_accuracy

    test_envs = rundir_lib.read_config(dirs[0])["test_envs"]

    def line(name, record, extra=""):
        train_envs = [int(k[3:].split("_")[0]) for k in record if k.endswith("_out_acc")]
        score = validation_accuracy(record, [e for e in train_envs if e not in test_envs])
        tests = "  ".join(f"env{e} {100 * record[f'env{e}_in_acc']:5.1f}" for e in test_envs)
        return f"  {name:<22} validation {100 * score:5.1f}   test {tests or '-'}{extra}"

    lines = ["The members (their selected step) and the averages, accuracy in %:"]
    for path in dirs:
        config = rundir_lib.read_config(path)
        record = training_domain_validation(rundir_lib.read_records(path), config["test_envs"])
        settings = f"   lr {config['lr']:.1e} wd {config['weight_decay']:.0e} dropout {config['dropout']}"
        lines.append(line(os.path.basename(path), record, settings))
    for name, record in averages.items():
        lines.append(line(f"{name} ({record['algorithm']})", record))
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags, logging

    from sagm_jax import cpu

    del argv
    cpu.configure()
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    f = flags.FLAGS
    workdir = f.workdir or os.path.join("runs", "population", f.recipe)
    try:
        run_population(f.config, workdir, f.recipe, f.members, f.pack, f.space,
                       f.linear_probe_steps, tuple(p for p in f.aux_runs.split(",") if p),
                       tuple(k for k in f.keep.split(",") if k))
    except ValueError as error:
        print(f"population: {error}", file=sys.stderr)
        return 2
    return 0


def define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", help_string="A configs/*.py file.")
    flags.DEFINE_string("workdir", None, "The population's folder (default runs/population/RECIPE).")
    flags.DEFINE_enum("recipe", "diwa", RECIPES, "diwa, eoa or ratatouille.")
    flags.DEFINE_integer("members", 8, "M, the population's runs.", lower_bound=1)
    flags.DEFINE_integer("pack", 8, "Runs trained together as one program.", lower_bound=1)
    flags.DEFINE_enum("space", None, ("diwa", "domainbed", "eoa"),
                      "The members' search space (default: the recipe's reference's).")
    flags.DEFINE_integer("linear_probe_steps", None,
                         "Steps of the shared start's linear probe (default: config.steps).",
                         lower_bound=1)
    flags.DEFINE_string("aux_runs", "", "Ratatouille: comma-separated folders of auxiliary runs.")
    flags.DEFINE_string("keep", "", "Comma-separated keys the members do not draw (the "
                        "config's value stays), e.g. batch_per_env: one program for all.")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
