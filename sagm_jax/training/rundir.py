"""The run directory: every file name in it, its records, and every reader of them.

    config.json      the run's config, written only once the run can start
    run_info.json    weights file and SHA-256, dataset fingerprint, class and
                     environment names, input shape, devices, versions
    split.json       split indices, file lists and dataset fingerprint (sagm_jax.data),
                     written when the run starts at step 0, checked when it resumes
    results.jsonl    one DomainBed-compatible record per evaluation (:func:`make_record`),
                     one JSON line each; its ``args.algorithm`` is the method's label
                     (:func:`record_algorithm`), the update rule is ``config.algorithm``
    checkpoints/     the kept train states (sagm_jax.training.checkpoints)
    run.lock         held by the one process that trains the directory (sagm_jax.main)
    done             written last; a finished run is never trained again

:func:`find_runs` is how everything that reads many runs finds them (the result
tables, the sweep's status, the sharpness curves, the Ctrl-C message).

A relaunch compares its config with ``config.json`` BEFORE anything else, finished run
or not: another config in the same directory is refused, naming the keys that differ.

Records are appended as whole lines ending in a newline and fsynced. A write torn by a
full disk or a kill leaves a last line without its newline (or not valid JSON): readers
drop it with a warning, and a resumed run rewrites the file without it and repeats that
evaluation. Any other unreadable line (a line that is not UTF-8 text among them: records
are ASCII, so a torn write never makes one) is an error naming the file and the line.

Every reader checks the steps of the records (:func:`check_steps`): a record's
``config`` says which evaluations the run makes (:func:`evaluation_steps`), so a
finished run must hold each exactly once, an unfinished one a prefix of them, and a run
resumed at step ``s`` every one before ``s``. A gap or a repeat (a record lost or
duplicated by hand, or by a copy) is an error naming the file and the steps. Records
without a ``config`` (written by DomainBed's train.py) cannot be checked so; they follow
DomainBed's rules (sagm_jax.collect_results). On a run with a gap or a repeat,
:func:`find_runs` raises, or, given a list, sets the run aside there (the result tables
then leave it out and name it).
"""

from __future__ import annotations

import collections
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
WALL_TIME = "wall_time.json"  # the seconds of the launch that finished the run
SWAD_RESULTS = "swad.jsonl"  # the SWAD model's one record (a SWAD run)
SWAD_MODEL = "swad_model"  # the SWAD model's variables
# A run combined from finished runs (a soup or an ensemble, ``sagm_jax.averaging``): its
# config.json is its first member's with these two keys, and its one record's row is
# the label (:func:`combined_label`).
COMBINED_LABEL = "combined_label"
COMBINED_MEMBERS = "combined_members"
MIXSTYLE = " + MixStyle"  # what MixStyle adds to a method's label
MIXSTYLE2 = " + Mixstyle2"  # MixStyle across domains (``mixstyle_mix="crossdomain"``)


def combined_label(record: dict) -> str | None:
    """The label of a record of a run combined from finished runs (a soup, an ensemble:
    its config's :data:`COMBINED_LABEL`), the row the tables put it in; None for any
    other record."""
    config = record.get("config")
    return config.get(COMBINED_LABEL) if isinstance(config, dict) else None


def mixstyle_suffix(config_dict) -> str:
    """What a run's MixStyle adds to its method's label: " + MixStyle", " + Mixstyle2" for
    the SAGM repository's cross-domain mix, "" without MixStyle."""
    if not config_dict.get("mixstyle"):
        return ""
    return MIXSTYLE2 if config_dict.get("mixstyle_mix") == "crossdomain" else MIXSTYLE

# The methods that DomainBed's ``domainbed/algorithms.py`` names otherwise than
# ``methods.method_label``: its class names (``ALGORITHMS``) ``Mixup``, ``ANDMask`` and
# ``SANDMask``. The other labels of a single method are already DomainBed's names
# (``ERM``, ``CORAL``, ``MMD``, ``GroupDRO``, ``IRM``, ``VREx``, ``Fish``, ``MLDG``,
# ``Transfer``).
DOMAINBED_ALGORITHMS = {"ERM + Mixup": "Mixup", "AND-mask": "ANDMask", "SAND-mask": "SANDMask"}

# Config keys that differ between the runs of one hyperparameter setting.
NOT_HPARAMS = ("test_envs", "all_test_envs", "trial_seed", "seed", "hparams_seed")

# The config fields (sagm_jax.config.FIELDS) that do not change what a run computes, so
# are not hyperparameters: where the data lives (the dataset's fingerprint says whether
# it is the same data), where the decoded stores live and how large one may be
# (image_store="auto" already picks store or streaming by the free disk, which no config
# holds), how much of the evaluation inputs is kept resident (the same batches either
# way), how often the training loss is logged. hparams_seed leaves them out and a
# relaunch may change them. Kept as hyperparameters: eval_batch_size, input, image_store,
# compute_dtype (other pixels, or float sums in another order or precision) and
# checkpoint (whether the run can resume). num_devices joins them where the perturbation
# is global (result_free_keys).
RESULT_FREE = ("data_dir", "cache_dir", "store_budget_gb", "eval_cache_gb", "log_every")
# Not result-free: eval_splits (which split parts each record holds). A relaunch that
# changes it is refused like any other change: the run's records would hold two kinds of
# record, and a finished run's results.jsonl would not be what its config says.

# Config fields added after runs were written: a config.json without the key ran as this
# value says (before eval_splits existed, every part of every environment was evaluated),
# so a relaunch of such a run with that value is the same run. Before the moving average
# (sagm_jax.averaging.moving_average) existed, a run predicted with its weights; before
# the linear probe and ERM++'s learning rate (sagm_jax.methods.linear_probe,
# sagm_jax.averaging.erm_plusplus), it had neither; before a shared start
# (sagm_jax.averaging.shared_init), every run started from its own initialisation.
ABSENT_MEANS = {"eval_splits": "all", "moving_average": False, "moving_average_start": 100,
                "moving_average_batchnorm_forward": False, "linear_steps": 0,
                "linear_lr": 0.0, "lr_plateau": False, "lr_schedule": [],
                "init_from": "", "init_weights": "last", "init_featurizer_from": ""}


def result_free_keys(config_dict: dict) -> tuple[str, ...]:
    """The keys of ``config_dict`` that do not change its run's result: :data:`RESULT_FREE`,
    and ``num_devices`` unless ``perturbation="per_device"`` (m-sharpness, whose result
    depends on the device count; the global perturbation is the one-device result)."""
    per_device = config_dict.get("perturbation", "global") == "per_device"
    return RESULT_FREE + (() if per_device else ("num_devices",))


def hyperparameters(config_dict: dict) -> dict:
    """The config without :data:`NOT_HPARAMS` and ``result_free_keys``: what
    names a hyperparameter setting (DomainBed's ``hparams``)."""
    dropped = set(NOT_HPARAMS) | set(result_free_keys(config_dict))
    return {k: v for k, v in config_dict.items() if k not in dropped}


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
    torn last line; their steps checked (:func:`check_steps`) as the run's ``done``
    says."""
    path = os.path.join(workdir, RESULTS)
    records = _read_records(path)[0]
    check_steps(path, records, finished=os.path.exists(os.path.join(workdir, DONE)))
    return records


def _read_records(path: str) -> tuple[list[dict], bool]:
    """``(records, torn)``: ``torn`` says a partial last line was dropped."""
    if not os.path.exists(path):
        return [], False
    with open(path, "rb") as f:
        lines = f.readlines()
    records = []
    for number, raw in enumerate(lines, 1):
        last = number == len(lines)
        line = _decoded(path, number, raw)
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


def _decoded(path: str, number: int, raw: bytes) -> str:
    """Line ``number`` as text. Records are ASCII JSON, so bytes that are not UTF-8 are
    no torn record but another file's content: an error, never a line to drop."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RecordsError(
            f"{path}, line {number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at "
            f"column {error.start + 1}); expected one JSON record per line. The file is "
            "damaged or not a results file: restore it, or rerun in a new --workdir."
        ) from None


def evaluation_steps(steps: int, eval_every: int) -> list[int]:
    """The steps a run evaluates (and records) after: ``t`` in ``0 .. steps-1`` with
    ``t % eval_every == 0`` or ``t == steps - 1``."""
    return sorted(set(range(0, steps, eval_every)) | ({steps - 1} if steps > 0 else set()))


def read_swad_record(workdir: str) -> dict | None:
    """The SWAD model's record of a finished SWAD run (swad.jsonl), or None."""
    path = os.path.join(workdir, SWAD_RESULTS)
    if not os.path.exists(path):
        return None
    records, _ = _read_records(path)
    return records[0] if records else None


def evaluation_interval(config) -> int:
    """The steps between evaluations of a run with ``config`` (a dict or ConfigDict):
    ``swad_eval_every`` with SWAD (its per-dataset frequency), else ``eval_every``."""
    return int(config["swad_eval_every"] if config.get("swad") else config["eval_every"])


def stops_early(config) -> bool:
    """Whether a finished run may end before ``steps``: SWAD stops when its loss valley
    ends (``swad_stop_at_valley_end``); its records are then a prefix of the steps."""
    return bool(config.get("swad") and config.get("swad_stop_at_valley_end", True))


def is_evaluation_step(t: int, steps: int, eval_every: int) -> bool:
    """Whether the run evaluates after step ``t`` (:func:`evaluation_steps`)."""
    return t % eval_every == 0 or t == steps - 1


def check_steps(path: str, records: list[dict], finished: bool, before: int | None = None):
    """Raises :class:`RecordsError` naming ``path`` and the steps unless ``records``
    hold, in order and once each, the evaluations their ``config`` makes: all of them
    when ``finished``, those before step ``before`` (a run resumed there), else a prefix.
    A finished SWAD run that stopped at the end of its loss valley (:func:`stops_early`)
    holds a prefix. Records without a ``config`` (DomainBed's) or whose config lacks
    ``steps`` or ``eval_every`` are not checked, nor a combined run's
    (:func:`combined_label`: one record of its own, at its members' latest step)."""
    config = records[0].get("config") if records else None
    if not isinstance(config, dict) or not {"steps", "eval_every"} <= set(config):
        return
    if config.get(COMBINED_LABEL):
        return
    expected = evaluation_steps(int(config["steps"]), evaluation_interval(config))
    steps = [r["step"] for r in records]
    counts = collections.Counter(steps)
    if finished and not stops_early(config):
        wanted = expected
    elif before is not None:
        wanted = [t for t in expected if t < before]
    else:
        wanted = [t for t in expected if steps and t <= max(steps)]
    problems = [
        f"{what} step(s) {found}"
        for what, found in (
            ("missing", sorted(set(wanted) - set(steps))),
            ("repeated", sorted(s for s, n in counts.items() if n > 1)),
            ("unexpected", sorted(set(steps) - set(expected))),
        )
        if found
    ]
    if not problems and steps != sorted(steps):
        problems.append(f"steps out of order {steps}")
    if problems:
        state = "finished" if finished else "unfinished"
        raise RecordsError(
            f"{path}: {'; '.join(problems)}. The {state} run's config (steps="
            f"{config['steps']}, evaluation every {evaluation_interval(config)}) evaluates after steps "
            f"{_steps_text(expected)}, each recorded once, in order. A record was lost or "
            "duplicated: restore the file, or rerun in a new --workdir."
        )


def missing_last_record(workdir: str, before: int | None = None) -> int | None:
    """The step of the run's last evaluation before step ``before`` (of all of them when
    None: a finished run) when its record alone is missing from ``results.jsonl`` (a
    torn or lost last line) and every one before it is there, in order; else None. The
    evaluations are those of ``config.json``."""
    try:
        config = read_config(workdir)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not {"steps", "eval_every"} <= set(config):
        return None
    expected = evaluation_steps(int(config["steps"]), evaluation_interval(config))
    if before is not None:
        expected = [t for t in expected if t < before]
    elif stops_early(config):
        return None  # its last record may be any evaluation's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the readers that drop a torn line say so
        records = _read_records(os.path.join(workdir, RESULTS))[0]
    steps = [r["step"] for r in records if before is None or r["step"] < before]
    return expected[-1] if expected and steps == expected[:-1] else None


def _steps_text(steps: list[int]) -> str:
    return str(steps) if len(steps) <= 8 else f"[{steps[0]}, {steps[1]}, ..., {steps[-1]}]"


def hparams_seed(config_dict: dict) -> int:
    """DomainBed's ``args.hparams_seed`` for a run: an integer naming its hyperparameter
    setting, the md5 of its :func:`hyperparameters`, reduced to 31 bits as DomainBed's
    ``seed_hash``. The runs of one setting share it across test environments, trial
    seeds and the settings that do not change the result (DomainBed's collector groups a
    sweep's runs by it, and matches leave-one-domain-out pairs through it); any other
    config difference gives another."""
    if config_dict.get("hparams_seed", -1) >= 0:  # a --hparams random setting's index
        return int(config_dict["hparams_seed"])
    text = json.dumps(hyperparameters(config_dict), sort_keys=True, default=str)
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16) % 2**31


def record_algorithm(config_dict: dict) -> str:
    """The record's ``args.algorithm``: the run's whole method, where DomainBed's
    ``collect_results`` reads it (one row per ``args.algorithm``), so that its rows tell
    our methods apart. DomainBed's class name where it has one (:data:`DOMAINBED_ALGORITHMS`,
    ``CORAL``, ``Fish``), else ``methods.method_label`` ("SAGM + CORAL", "DISAM on SAGM"),
    with :func:`mixstyle_suffix`; ERM++'s stage 2 (a ``lr_schedule``) is "ERM++"
    (``methods.averaging_label``: "SAGM + ERM++" for SAGM). Only the record holds it: ``hparams_seed`` and
    the sweep's job hashes come from the config, whose ``algorithm`` stays the update
    rule (our readers take the method from the config)."""
    from sagm_jax import methods  # the registries import JAX; reading records needs neither

    label = methods.method_label(
        config_dict.get("objective", "erm"),
        config_dict["algorithm"],
        float(config_dict.get("disam_lambda") or 0),
    )
    label = DOMAINBED_ALGORITHMS.get(label, label)
    if config_dict.get("lr_schedule"):  # ERM++'s stage 2 (sagm_jax.averaging.erm_plusplus)
        label = methods.averaging_label(methods.method_label(
            config_dict.get("objective", "erm"), config_dict["algorithm"],
            float(config_dict.get("disam_lambda") or 0)), "erm_plusplus")
    return label + mixstyle_suffix(config_dict)


def make_record(
    config_dict: dict,
    workdir: str,
    *,
    step: int,
    loss: float,
    accuracies: dict,
    test_envs: list[int],
    smallest_env: int,
    metrics: dict | None = None,
) -> dict:
    """The DomainBed-compatible record of evaluation ``step``: ``loss`` (the mean since
    the last record of the loss the method reports) and the method's other ``metrics``
    (``penalty``, ``nll``: DomainBed's keys, also means), ``env{i}_{part}_acc``, DomainBed's ``epoch`` (examples seen per
    training environment over the ``smallest_env`` examples of the smallest one's "in"
    part), its ``args`` (``algorithm``: :func:`record_algorithm`) and ``hparams``, and
    the whole config."""
    return {
        "step": step,
        "loss": loss,
        **(metrics or {}),
        "epoch": (step + 1) * config_dict["batch_per_env"] / smallest_env,
        **accuracies,
        "args": {
            "dataset": config_dict["dataset"],
            "algorithm": record_algorithm(config_dict),
            "test_envs": test_envs,
            "trial_seed": config_dict["trial_seed"],
            "seed": config_dict["seed"],
            "hparams_seed": hparams_seed(config_dict),
            "output_dir": os.path.abspath(workdir),
        },
        "hparams": hyperparameters(config_dict),
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


def find_runs(root: str, damaged: list | None = None) -> list[Run]:
    """Every run directory under ``root`` (``root`` itself included), in path order: a
    folder holding ``config.json`` or ``results.jsonl`` (DomainBed's runs have only the
    records). Checkpoint folders are not searched. A run whose records have a gap or a
    repeat (:func:`check_steps`), or hold a line that is not a record, is a
    :class:`RecordsError`; given a ``damaged`` list, it is appended there instead as
    ``(folder, the error's text)`` and left out of the runs returned."""
    runs = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != CHECKPOINTS)
        if CONFIG in files or RESULTS in files:
            path = os.path.join(folder, RESULTS)
            try:
                records = _read_records(path)[0]
                check_steps(path, records, finished=DONE in files)
            except RecordsError as error:
                if damaged is None:
                    raise
                damaged.append((folder, str(error)))
                continue
            runs.append(Run(folder, DONE in files, records))
    return sorted(runs, key=lambda run: run.path)


def read_wall_time(workdir: str) -> float | None:
    """The recorded seconds of the launch that finished the run at ``workdir``; None for a
    run not finished, or finished before runs recorded it."""
    if not os.path.exists(os.path.join(workdir, DONE)):
        return None
    try:
        with open(os.path.join(workdir, WALL_TIME)) as f:
            return float(json.load(f)["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_run_info(workdir: str) -> dict:
    """``workdir/run_info.json``: what the run was set up with (its input shape, class
    and environment names, weights, dataset fingerprint, devices)."""
    with open(os.path.join(workdir, RUN_INFO)) as f:
        return json.load(f)


def read_data_fingerprint(workdir: str) -> dict | None:
    """The dataset fingerprint in ``workdir/split.json`` (what identifies the data a run
    trained on, whatever its ``data_dir``), or None without a readable split record."""
    try:
        with open(os.path.join(workdir, SPLIT)) as f:
            return json.load(f).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def read_config(workdir: str) -> dict:
    """``workdir/config.json``: the run's config as a dict."""
    with open(os.path.join(workdir, CONFIG)) as f:
        return json.load(f)


def config_differences(workdir: str, config_dict: dict) -> list[str]:
    """The keys whose values differ between ``config_dict`` and ``workdir/config.json``
    (``[]`` when the directory holds no config yet), but for the settings that do not
    change the result (``result_free_keys`` of either); a key that either lacks counts
    as its :data:`ABSENT_MEANS` value."""
    path = os.path.join(workdir, CONFIG)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        previous = {**ABSENT_MEANS, **json.load(f)}
    current = {**ABSENT_MEANS, **json.loads(json.dumps(config_dict, default=str))}
    free = set(result_free_keys(previous)) & set(result_free_keys(current))
    keys = (set(previous) | set(current)) - free
    return sorted(k for k in keys if previous.get(k) != current.get(k))


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
            hint = ""
            if "eval_splits" in changed:
                recorded = {**ABSENT_MEANS, **read_config(self.workdir)}["eval_splits"]
                hint = (
                    f" Its records hold the parts of eval_splits={recorded!r}; to go on "
                    f"with it, relaunch with --config.eval_splits={recorded}."
                )
            raise ValueError(
                f"{os.path.join(self.workdir, CONFIG)} holds a run with a different config "
                f"(keys {changed} differ); resuming it would mix two runs. Use another "
                "--workdir, or delete that directory." + hint
            )

    @property
    def done(self) -> bool:
        return os.path.exists(os.path.join(self.workdir, DONE))

    def start(self, config_dict: dict, run_info: dict, dataset, write_split: bool = True):
        """Writes config.json, run_info.json and (``write_split``: a run starting at step
        0) split.json: the run is about to train. A resumed run keeps its split.json."""
        if not self.is_main:
            return
        os.makedirs(self.workdir, exist_ok=True)
        write_json(os.path.join(self.workdir, CONFIG), config_dict)
        write_json(os.path.join(self.workdir, RUN_INFO), run_info)
        if write_split:
            dataset.write_split(self.workdir)

    def records_before(self, step: int) -> list[dict]:
        """The records of steps before ``step`` (what a state restored at ``step`` has
        done), checked to be every evaluation before it (:func:`check_steps`); the main
        process rewrites results.jsonl to hold just those."""
        records, torn = _read_records(self.results)
        kept = [r for r in records if r["step"] < step]
        check_steps(self.results, kept, finished=False, before=step)
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

    def write_swad_record(self, record: dict) -> None:
        """Writes the SWAD model's record to swad.jsonl (one line, atomically)."""
        if self.is_main:
            tmp = os.path.join(self.workdir, SWAD_RESULTS + ".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            os.replace(tmp, os.path.join(self.workdir, SWAD_RESULTS))

    def mark_done(self, wall_time_s: float | None = None) -> None:
        """Marks the run finished, first recording ``wall_time_s`` (the seconds of the
        launch that finished it) for a relaunch to print."""
        if self.is_main:
            if wall_time_s is not None:
                with open(os.path.join(self.workdir, WALL_TIME), "w") as f:
                    json.dump({"seconds": round(wall_time_s, 3)}, f)
            with open(os.path.join(self.workdir, DONE), "w") as f:
                f.write("done\n")
