"""The run directory: every file name in it, its records, and every reader of them.

    config.json      the run's config, written only once the run can start
    run_info.json    weights file and SHA-256, dataset fingerprint, class and
                     environment names, input shape, devices, versions
    split.json       split indices, file lists and dataset fingerprint (sagm_jax.data)
    results.jsonl    one DomainBed-compatible record per evaluation (:func:`make_record`),
                     one JSON line each
    checkpoints/     the kept train states (sagm_jax.checkpoints)
    run.lock         held by the one process that trains the directory (sagm_jax.main)
    done             written last; a finished run is never trained again

:func:`find_runs` is how everything that reads many runs finds them (the result
tables, the sweep's status, the sharpness curves, the Ctrl-C message).

A relaunch compares its config with ``config.json`` BEFORE anything else, finished run
or not: another config in the same directory is refused, naming the keys that differ.

Records are appended as whole lines ending in a newline and fsynced. A write torn by a
full disk or a kill leaves a last line without its newline (or not valid JSON): readers
drop it with a warning, and a resumed run rewrites the file without it and repeats that
evaluation. Any other unreadable line is an error naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings

CONFIG = "config.json"
RUN_INFO = "run_info.json"
SPLIT = "split.json"
RESULTS = "results.jsonl"
CHECKPOINTS = "checkpoints"
RUN_LOCK = "run.lock"
DONE = "done"

# Config keys that differ between the runs of one hyperparameter setting.
NOT_HPARAMS = ("test_envs", "all_test_envs", "trial_seed", "seed")


class RecordsError(ValueError):
    """results.jsonl holds a line that is not a record (not a torn last line)."""


def write_json(path: str, obj) -> None:
    """Writes ``obj`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def read_records(workdir: str) -> list[dict]:
    """The records of ``workdir/results.jsonl`` (``[]`` if there is none), without a
    torn last line."""
    return _read_records(os.path.join(workdir, RESULTS))[0]


def _read_records(path: str) -> tuple[list[dict], bool]:
    """``(records, torn)``: ``torn`` says a partial last line was dropped."""
    if not os.path.exists(path):
        return [], False
    with open(path) as f:
        lines = f.readlines()
    records = []
    for number, line in enumerate(lines, 1):
        last = number == len(lines)
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as error:
            if last:
                warnings.warn(f"{path}: dropped a torn last line ({len(line)} bytes).")
                return records, True
            raise RecordsError(f"{path}, line {number}: not a JSON record ({error}).") from None
        if record is None:
            continue
        if last and not line.endswith("\n"):
            warnings.warn(f"{path}: dropped a last line without its newline (a torn write).")
            return records, True
        if not isinstance(record, dict) or "step" not in record:
            raise RecordsError(f"{path}, line {number}: expected a record with a 'step' key.")
        records.append(record)
    return records, False


def hparams_seed(config_dict: dict) -> int:
    """DomainBed's ``args.hparams_seed`` for a run: an integer naming its hyperparameter
    setting, the md5 of its config without :data:`NOT_HPARAMS`, reduced to 31 bits as
    DomainBed's ``seed_hash``. The runs of one setting share it across test environments
    and trial seeds (DomainBed's collector groups a sweep's runs by it, and matches
    leave-one-domain-out pairs through it); any other config difference gives another."""
    setting = {k: v for k, v in config_dict.items() if k not in NOT_HPARAMS}
    text = json.dumps(setting, sort_keys=True, default=str)
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16) % 2**31


def make_record(
    config_dict: dict,
    workdir: str,
    *,
    step: int,
    loss: float,
    accuracies: dict,
    test_envs: list[int],
    smallest_env: int,
) -> dict:
    """The DomainBed-compatible record of evaluation ``step``: ``loss`` (the mean since
    the last record), ``env{i}_{part}_acc``, DomainBed's ``epoch`` (examples seen per
    training environment over the ``smallest_env`` examples of the smallest one's "in"
    part), its ``args`` and ``hparams``, and the whole config."""
    return {
        "step": step,
        "loss": loss,
        "epoch": (step + 1) * config_dict["batch_per_env"] / smallest_env,
        **accuracies,
        "args": {
            "dataset": config_dict["dataset"],
            "algorithm": config_dict["algorithm"],
            "test_envs": test_envs,
            "trial_seed": config_dict["trial_seed"],
            "seed": config_dict["seed"],
            "hparams_seed": hparams_seed(config_dict),
            "output_dir": os.path.abspath(workdir),
        },
        "hparams": {k: v for k, v in config_dict.items() if k not in NOT_HPARAMS},
        "config": config_dict,
    }


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory found by :func:`find_runs`: its path, whether it is ``done``,
    and its records (a torn last line dropped, with a warning)."""

    path: str
    done: bool
    records: list[dict]

    @property
    def last_step(self) -> int | None:
        return self.records[-1]["step"] if self.records else None


def find_runs(root: str) -> list[Run]:
    """Every run directory under ``root`` (``root`` itself included), in path order: a
    folder holding ``config.json`` or ``results.jsonl`` (DomainBed's runs have only the
    records). Checkpoint folders are not searched."""
    runs = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != CHECKPOINTS)
        if CONFIG in files or RESULTS in files:
            records = _read_records(os.path.join(folder, RESULTS))[0]
            runs.append(Run(folder, DONE in files, records))
    return sorted(runs, key=lambda run: run.path)


def read_run_info(workdir: str) -> dict:
    """``workdir/run_info.json``: what the run was set up with (its input shape, class
    and environment names, weights, dataset fingerprint, devices)."""
    with open(os.path.join(workdir, RUN_INFO)) as f:
        return json.load(f)


def read_config(workdir: str) -> dict:
    """``workdir/config.json``: the run's config as a dict."""
    with open(os.path.join(workdir, CONFIG)) as f:
        return json.load(f)


def config_differences(workdir: str, config_dict: dict) -> list[str]:
    """The keys whose values differ between ``config_dict`` and ``workdir/config.json``
    (``[]`` when the directory holds no config yet)."""
    path = os.path.join(workdir, CONFIG)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        previous = json.load(f)
    current = json.loads(json.dumps(config_dict, default=str))
    return sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))


class RunDir:
    """One run's directory. Only the main process (``is_main``) writes; every process
    reads (multi-host runs share the directory, as they share the checkpoints)."""

    def __init__(self, workdir: str, is_main: bool = True):
        self.workdir, self.is_main = workdir, is_main
        self.results = os.path.join(workdir, RESULTS)

    def check_config(self, config_dict: dict) -> None:
        """Raises if the directory holds a run with another config."""
        changed = config_differences(self.workdir, config_dict)
        if changed:
            raise ValueError(
                f"{os.path.join(self.workdir, CONFIG)} holds a run with a different config "
                f"(keys {changed} differ); resuming it would mix two runs. Use another "
                "--workdir, or delete that directory."
            )

    @property
    def done(self) -> bool:
        return os.path.exists(os.path.join(self.workdir, DONE))

    def start(self, config_dict: dict, run_info: dict, dataset) -> None:
        """Writes config.json, run_info.json and split.json: the run is about to train."""
        if not self.is_main:
            return
        os.makedirs(self.workdir, exist_ok=True)
        write_json(os.path.join(self.workdir, CONFIG), config_dict)
        write_json(os.path.join(self.workdir, RUN_INFO), run_info)
        dataset.write_split(self.workdir)

    def records_before(self, step: int) -> list[dict]:
        """The records of steps before ``step`` (what a state restored at ``step`` has
        done); the main process rewrites results.jsonl to hold just those."""
        records, torn = _read_records(self.results)
        kept = [r for r in records if r["step"] < step]
        if self.is_main and (torn or len(kept) < len(records) or not os.path.exists(self.results)):
            tmp = self.results + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in kept)
            os.replace(tmp, self.results)
        return kept

    def append(self, record: dict) -> None:
        if not self.is_main:
            return
        with open(self.results, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def mark_done(self) -> None:
        if self.is_main:
            with open(os.path.join(self.workdir, DONE), "w") as f:
                f.write("done\n")
