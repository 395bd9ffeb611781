"""The sweep's checks of its jobs before any is launched: the checks ``sagm_jax.main`` runs.

Each job's config is built as its run builds it: its config file loaded from the
repository (the jobs run there), then each ``--config.KEY=VALUE`` of the job's command
parsed by ml-collections' own flag parser and set. Each config then goes through the
checks of the command line before a run: ``sagm_jax.cli.check_overrides`` (unknown
keys), ``sagm_jax.config.config_problems`` (values, and combinations that are not
methods) and ``sagm_jax.config.unused_setting_problems`` (a ``--set`` of one method's
hyperparameter for a job of another method); what depends on this machine's files (data, weights) is left to the run.
A config file is loaded once, a key looked up and a value parsed once per file, so a
sweep of thousands of jobs is checked in seconds.

One problem is not the user's to fix: MLDG's meta-test split drawn (or set) larger
than a job's training environments allow (``sagm_jax.config.mldg_problem``). DomainBed
runs such a job, and its ``MLDG.update`` then trains nothing (no meta-train domain:
Adam steps on zero gradients); training-domain validation never selects it. The sweep
leaves the job out instead, one line each (:attr:`Report.skipped`).
"""

from __future__ import annotations

import os
import re
import sys
from typing import NamedTuple
from unittest import mock

import ml_collections

from sagm_jax import cli, config as config_lib
from sagm_jax.sweep.jobs import SWEEP_KEYS, Job

OVERRIDE = re.compile(r"--config\.([\w.]+)=(.*)", re.S)
# The keys a problem line names: "config.KEY=", "--config.KEY=" or "--config.KEY:".
NAMED_KEY = re.compile(r"config\.([\w.]+)[=:]")


class Report:
    """What :func:`check_jobs` found: ``problems`` (lines, each naming the --set or
    --grid flag, or the jobs, it comes from) and ``skipped`` (``(job, why)`` for each job
    left out)."""

    def __init__(self):
        self.problems: list[str] = []
        self.skipped: list[tuple[Job, str]] = []


class Flags(NamedTuple):
    """The sweep's own words for a key: ``{key: "--set key=value"}`` and
    ``{key: "--grid key=v1,v2"}``."""

    set_items: dict
    grid_items: dict

    @classmethod
    def from_items(cls, set_items=(), grid_items=()) -> "Flags":
        def by_key(flag, items):
            return {item.partition("=")[0]: f"{flag} {item}" for item in items}

        return cls(by_key("--set", set_items), by_key("--grid", grid_items))

    def origin(self, keys) -> str | None:
        """The flag that gave one of ``keys``, None when the sweep chose them all."""
        for table in (self.set_items, self.grid_items):
            for key in keys:
                if key in table:
                    return table[key]
        return None


class Builder:
    """Builds the jobs' configs, with each config file, key and value read once."""

    def __init__(self):
        self.files, self.keys, self.values = {}, {}, {}
        # Per config file: one config that each job's values are set on in turn (a
        # ConfigDict per job would take most of the time), and the keys set last.
        self.working, self.changed = {}, {}

    def base(self, path: str):
        """``(config, None)`` of a config file, or ``(None, problem)``."""
        if path not in self.files:
            try:
                self.files[path] = (cli.load_config_file(_in_repository(path)), None)
            except cli.UsageError as error:
                self.files[path] = (None, str(error))
        return self.files[path]

    def key_problem(self, path: str, base, key: str) -> str | None:
        """What ``main`` says of ``--config.KEY`` (no such key), or None."""
        if (path, key) not in self.keys:
            try:
                cli.check_overrides([f"--config.{key}="], base, path)
                self.keys[path, key] = None
            except cli.UsageError as error:
                self.keys[path, key] = str(error)
        return self.keys[path, key]

    def value(self, path: str, base, key: str, text: str):
        """``(value, None)`` as ml-collections parses ``--config.KEY=text`` for this
        file, or ``(None, problem)``."""
        if (path, key, text) not in self.values:
            value, problem = _parse_override(_in_repository(path), key, text)
            if problem:
                problem += f" (config.{key} expects {type(base.get(key)).__name__} values)"
            self.values[path, key, text] = value, problem
        return self.values[path, key, text]

    def config(self, job: Job) -> tuple[ml_collections.ConfigDict | None, list[tuple]]:
        """The job's config (valid until the next call; None if its file does not
        load) with the overrides that parse, and ``(keys, problem)`` for the others."""
        path = job.args["config"]
        base, problem = self.base(path)
        if problem:
            return None, [((), problem)]
        values, problems = {}, []
        for arg in job.command():
            match = OVERRIDE.fullmatch(arg)
            if not match:
                continue
            key, text = match.groups()
            problem = self.key_problem(path, base, key)
            if problem is None:
                value, problem = self.value(path, base, key, text)
            if problem:
                problems.append(((key,), problem))
            else:
                values[key] = value
        if path not in self.working:
            self.working[path], self.changed[path] = ml_collections.ConfigDict(base), set()
        config = self.working[path]
        for key in self.changed[path] - set(values):
            config[key] = base[key]
        for key, value in values.items():
            config[key] = value
        self.changed[path] = set(values)
        return config, problems


def _in_repository(path: str) -> str:
    """A job's config file as its run opens it: relative to the repository."""
    return path if os.path.isabs(path) else os.path.join(cli.REPO, path)


def _parse_override(path: str, key: str, text: str):
    """``--config.KEY=text`` parsed as ``sagm_jax.main`` parses it (ml-collections'
    config flag, which reads its overrides from ``sys.argv``): ``(value, None)`` or
    ``(None, problem)``."""
    from absl import flags
    from ml_collections import config_flags

    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, lock_config=True)
    argv = [cli.PROGRAM, f"--config={path}", f"--config.{key}={text}"]
    try:
        with mock.patch.object(sys, "argv", argv):
            flag_values(argv)
        return flag_values.config[key], None
    except flags.Error as error:
        return None, str(error)


def _mldg_reason(config) -> str:
    n, m = config.mldg_n_meta_test, config_lib.training_environments(config)
    return (
        f"mldg_n_meta_test={n} leaves no meta-train domain among its {m} training "
        "environments (DomainBed would run it and train nothing)"
    )


def check_jobs(jobs: list[Job], flags: Flags = Flags({}, {})) -> Report:
    """Every job's config built and checked (the module docstring): the problems, each
    once, naming the flag or the jobs it comes from; and the jobs left out."""
    builder, report, found = Builder(), Report(), {}
    checked = {}
    for job in jobs:
        config, problems = builder.config(job)
        if config is not None:
            if not problems and config_lib.mldg_problem(config):
                report.skipped.append((job, _mldg_reason(config)))
                continue
            given = sorted(key for key in job.args if key != "config")
            frozen = (job.args["config"], repr(sorted(config.items())), tuple(given))
            if frozen not in checked:
                checked[frozen] = [
                    (tuple(NAMED_KEY.findall(p)), p)
                    for p in config_lib.config_problems(config)
                    + config_lib.unused_setting_problems(config, given)
                ]
            problems = problems + checked[frozen]
        for keys, problem in problems:
            found.setdefault((flags.origin(keys), problem), []).append(job)
    for (origin, problem), affected in found.items():
        if origin is None:
            first = affected[0].describe(sorted(set(affected[0].args) - set(SWEEP_KEYS)))
            origin = f"job {first}" if len(affected) == 1 else (
                f"{len(affected)} jobs (the first: {first})"
            )
        report.problems.append(f"{origin}: {problem}")
    return report
