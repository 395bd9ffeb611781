"""What ``python -m sagm_jax.main`` tells its user: help, checks before a run, errors.

Owns everything around the training call: ``--help`` (the flags, then every config
field with its value and meaning from :func:`sagm_jax.config.fields`); the checks of
the command line before absl parses it (``--config`` missing or unreadable, unknown
keys); the checks of the loaded config before anything heavy starts, which list every
missing input at once with the flag that supplies it (data and the layout of its
folders, weights files and their format, values, a method's setting given for a run
without the method, a batch the devices cannot share, a workdir that cannot be made or
written), and print its warnings; the
default run directory; one message and a non-zero exit instead of a traceback for the
errors a user can fix; the message after Ctrl-C; and a quiet TensorFlow start-up.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import textwrap
import time
from typing import Callable, Sequence

import ml_collections

from sagm_jax import config as config_lib
from sagm_jax import models
from sagm_jax.formatting import flag_value
from sagm_jax.models.backbones import BACKBONES
from sagm_jax.training.rundir import CHECKPOINTS, find_runs

PROGRAM = "python -m sagm_jax.main"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")
# Errors a user can fix from their message (bad values, missing files, an unusable
# workdir, a diverged run, a missing optional dependency): printed without traceback.
USER_ERRORS = (ValueError, OSError, FloatingPointError, ImportError)

# Exit statuses.
USAGE, FAILED, INTERRUPTED = 2, 1, 130


class UsageError(Exception):
    """A command that cannot start; the message says what to pass instead."""


def launch_start() -> float:
    """``time.monotonic()`` at this process's start, so that a launch's wall time counts
    its imports and checks (Linux: from /proc, the start in clock ticks after boot and
    the uptime); the time of the call where /proc cannot tell."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:  # field 22, after the ")" that ends the name
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(0.0, uptime - started), now)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- before absl parses the flags -------------------------------------------------


def _config_path(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1].split(":", 1)[0]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1].split(":", 1)[0]
    return None


def _config_files() -> str:
    names = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
    relative = [os.path.relpath(n) for n in names]
    if any(r.startswith("..") for r in relative):  # not run from the repository
        relative = names
    return ", ".join(relative) or "configs/*.py"


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """``get_config()`` of a config file; UsageError naming the file if that fails."""
    if not os.path.isfile(path):
        raise UsageError(
            f"--config={path}: no such file. Expected one of {_config_files()} "
            "(a Python file with get_config())."
        )
    spec = importlib.util.spec_from_file_location("_sagm_jax_config_file", path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception as error:  # the file itself is broken: say which and how
        raise UsageError(
            f"--config={path}: could not load it ({type(error).__name__}: {error}). "
            "Expected a Python file whose get_config() returns an ml_collections.ConfigDict."
        ) from None


def check_overrides(argv: Sequence[str], config: ml_collections.ConfigDict, path: str) -> None:
    """UsageError listing the valid keys if a ``--config.KEY`` of ``argv`` names no key of
    ``config`` (the one loaded from ``path``); ml-collections alone answers with a bare
    AttributeError."""
    valid = config_lib.flat_keys(config)
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)(=|$)", arg)
        if match and match.group(1) not in valid:
            close = close_name(match.group(1), valid)
            hint = (
                f"did you mean `{close}`? (--help lists every key)"
                if close
                else f"Valid keys: {', '.join(sorted(valid))}."
            )
            raise UsageError(f"--config.{match.group(1)}: no such key in {path}; {hint}")


def close_name(name: str, names: Sequence[str]) -> str | None:
    """The one of ``names`` closest to ``name``, compared case-insensitively (``Fish``
    finds ``fish``), or None when none is close."""
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return by_lower[close[0]] if close else None


def value_suggestions(
    config: ml_collections.ConfigDict, device_count: int | None = None
) -> dict[str, str]:
    """For each problem of :func:`sagm_jax.config.field_problems` whose field names one of
    a list of names and whose value is close to one of them, ``did you mean ...?``."""
    checks = {field.key: field.check for field in config_lib.all_fields()}
    hints = {}
    for key, problem in config_lib.field_problems(config, device_count):
        names, value = getattr(checks[key], "names", None), config.get(key)
        if names and isinstance(value, str) and (close := close_name(value, names)):
            hints[problem] = f" Did you mean --config.{key}={close}?"
    return hints


def check_command_line(argv: Sequence[str]) -> None:
    """``--help`` prints the help and exits 0; a missing or unloadable ``--config`` or an
    unknown ``--config.KEY`` exits 2 with one message. Runs before absl, whose own
    answers to these are a traceback or exit status 1."""
    args = list(argv[1:])
    if any(a in HELP_FLAGS for a in args):
        print(help_text(_config_path(args)))
        raise SystemExit(0)
    try:
        path = _config_path(args)
        if path is None:
            raise UsageError(
                "--config is missing.\n"
                f"  usage: {PROGRAM} --config=configs/DATASET.py [--workdir=DIR] "
                "[--config.KEY=VALUE ...]\n"
                + textwrap.fill(
                    f"configs: {_config_files()}",
                    100,
                    initial_indent="  ",
                    subsequent_indent="           ",
                    break_on_hyphens=False,
                )
                + f"\n  offline start: {PROGRAM} --config=configs/rotated_digits.py\n"
                f"  every field, with its default and meaning: {PROGRAM} --help"
            )
        check_overrides(args, load_config_file(path), path)
    except UsageError as error:
        _say(f"{PROGRAM}: {error}")
        raise SystemExit(USAGE) from None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (``app.run(..., flags_parser=parse_flags)``), with a value
    that does not parse reported as one message naming the field's type, exit status 2."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        message = str(error)
        match = re.match(r"flag --config\.([\w.]+)=", message)
        if match:
            with contextlib.suppress(Exception):
                default = load_config_file(_config_path(argv[1:]))[match.group(1)]
                message += f" (config.{match.group(1)} expects {type(default).__name__} values"
                message += f", e.g. --config.{match.group(1)}={flag_value(default)})"
        _say(f"{PROGRAM}: {message}")
        raise SystemExit(USAGE) from None


def help_text(path: str | None = None) -> str:
    """Usage, flags, and every config field with its value (of ``path``'s config when
    given, else the defaults) and its meaning."""
    values, source = config_lib.base_config(), "the base config's defaults"
    if path:
        try:
            values, source = load_config_file(path), f"the values of {path}"
        except UsageError as error:
            source = f"the base config's defaults ({error})"
    lines = [
        f"usage: {PROGRAM} --config=configs/DATASET.py [--workdir=DIR] [--config.KEY=VALUE ...]",
        "",
        "Trains one run (or, with --config.all_test_envs=True, one per test environment) and",
        "writes its records, checkpoints and summary to the run directory. Ctrl-C stops it;",
        "the same command resumes it.",
        "",
        "flags:",
        *textwrap.wrap(
            f"  --config=FILE        one of {_config_files()}",
            width=100,
            subsequent_indent=" " * 23,
            break_on_hyphens=False,
        ),
        "  --workdir=DIR        the run directory; default:",
        "                       workdirs/<dataset>-<algorithm>-test<envs>-trial<t>-<config hash>",
        "  --config.KEY=VALUE   override a config field (below)",
        "  --distributed        call jax.distributed.initialize() first (one process per host);",
        "                       --coordinator_address, --num_processes, --process_id where",
        "                       the cluster does not configure itself",
        "  --traceback          show the Python traceback of an error",
        "  --verbosity=N        absl logging (default: warnings only); --helpfull: absl's flags",
        "",
        f"config fields ({source}):",
    ]
    for section, fields in config_lib.fields().items():
        lines.append(f"  {config_lib.SECTION_TITLES[section]}")
        for field in fields:
            flag = f"    --config.{field.key}={flag_value(values.get(field.key))}"
            text = f"{flag:<44} {field.meaning}"
            if len(flag) >= 44:
                text = f"{flag}\n{'':<44} {field.meaning}"
            lines += textwrap.wrap(
                text,
                width=100,
                subsequent_indent=" " * 45,
                break_long_words=False,
                break_on_hyphens=False,
            )
    return "\n".join(lines)


# --- after absl: the loaded config --------------------------------------------------


def default_workdir(config: ml_collections.ConfigDict) -> str:
    """``workdirs/<dataset>-<algorithm>[-<objective>][-swad]-test<envs>-trial<t>-<md5 of the
    config, 8 hex>`` (the objective where it is not erm, ``swad`` where SWAD is on): the
    same command finds its run again, any other config gets its own directory."""
    envs = "all" if config.all_test_envs else "_".join(str(e) for e in config.test_envs)
    digest = hashlib.md5(
        json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
    ).hexdigest()[:8]
    method = [config.algorithm]
    if config.get("objective", "erm") != "erm":
        method.append(str(config.objective))
    if config.get("swad") is True:
        method.append("swad")
    name = f"{config.dataset}-{'-'.join(method)}-test{envs}-trial{config.trial_seed}-{digest}"
    return os.path.join("workdirs", name)


def _data_problems(config) -> list[str]:
    """What keeps a folder dataset from being read, found by listing folders (no image is
    opened): a missing data_dir or dataset folder (one line: nothing else can be
    checked), else every problem of its tree at once (``registry.folder_problems``) and,
    for an image folder, test_envs against its domain folders."""
    from sagm_jax.data import registry

    spec = registry.DATASETS.get(config.dataset)
    if spec is None or spec.kind != "folder":
        return []  # in memory (an unknown name is reported by preflight)
    layout = (
        "DATA_DIR/<domain>/<class>/<image>"
        if spec.folder is None
        else f"DATA_DIR/{spec.folder}/<domain>/<class>/<image>"
    )
    get = (
        "Get it as the README's 'Getting the data' says, then check it with "
        f"`python -m sagm_jax.data.verify --dataset={config.dataset} --data_dir=DATA_DIR`."
    )
    if not config.data_dir:
        return [
            f"--config.data_dir=DATA_DIR is missing: {config.dataset} is read from {layout}. {get}"
        ]
    if not os.path.isdir(config.data_dir):
        return [f"--config.data_dir={config.data_dir}: no such directory. Expected {layout}. {get}"]
    root = registry.dataset_root(spec, config.data_dir)
    if not os.path.isdir(root):
        return [
            f"--config.data_dir={config.data_dir}: it has no {spec.folder}/ folder; "
            f"{config.dataset} is read from {layout}. {get}"
        ]
    problems = registry.folder_problems(spec, config.data_dir)
    if spec.domains is None and (envs := _folder_test_envs_problem(config, root)):
        problems.append(envs)
    return problems


def _listed_domains(config) -> int | None:
    """The domain folders of an image folder (its environments), None for a dataset
    whose environments the registry knows or a folder that is not there."""
    from sagm_jax.data import registry, splits

    spec = registry.DATASETS.get(config.dataset)
    if spec is None or spec.kind != "folder" or spec.domains or not config.data_dir:
        return None
    root = registry.dataset_root(spec, config.data_dir)
    return len(splits.list_domains(root)) if os.path.isdir(root) else None


def reference_defaults(config: ml_collections.ConfigDict, argv: Sequence[str]) -> list[str]:
    """Sets what a method's reference fixes where the command line leaves it: ARM's
    ``batch_per_env`` outside the MNIST-like datasets (DomainBed's ``hparams_registry``:
    8, ``sagm_jax.sweep.hparams.FIXED_IMAGE_BATCH``; the sweep's default and draws are
    the same). Returns a line for the user for each setting it changed, and one where an
    objective named on the command line trains under the config file's update rule
    rather than its reference's plain Adam (``algorithm=erm``): the offline default's
    ``--config.objective=mtl`` alone is MTL + SAGM, which DomainBed's MTL is not."""
    from sagm_jax.data.registry import DATASETS
    from sagm_jax.sweep.hparams import FIXED_IMAGE_BATCH, is_mnist_like

    objective, dataset, given = config.get("objective"), config.get("dataset"), _given_keys(argv)
    lines = []
    if "objective" in given and "algorithm" not in given and "erm" not in (
        objective, config.get("algorithm")
    ):
        lines.append(
            f"objective={objective} trains under algorithm={config.algorithm} (the config "
            "file's); its reference steps with plain Adam: --config.algorithm=erm."
        )
    if dataset not in DATASETS:
        return lines
    lines += _dataset_defaults(config, given)
    size = FIXED_IMAGE_BATCH.get(objective)
    if (size is None or is_mnist_like(dataset)
            or "batch_per_env" in given or config.batch_per_env == size):
        return lines
    config.batch_per_env = size
    return lines + [f"objective={objective}: batch_per_env={size}, DomainBed's batch for it "
                    f"on {dataset} (--config.batch_per_env=N sets another)."]


# Keys a method's per-dataset defaults leave to the config file on a single run: its
# learning rate and decay are the paper's per-dataset values (the sweep draws DomainBed's).
KEEP_CONFIG_KEYS = ("lr", "weight_decay")


def _dataset_defaults(config: ml_collections.ConfigDict, given: Sequence[str]) -> list[str]:
    """Sets the method's own per-dataset defaults (``Method.by_dataset``, e.g. RDM's
    rdm_lambda on PACS, its batch of 88) that the command line leaves; one line naming
    them, or none."""
    from sagm_jax.sweep.hparams import dataset_hparams

    changed = dataset_hparams(config.algorithm, config.dataset, config.objective)
    set_here = []
    for key, (default, _) in changed.items():
        if key in given or key in KEEP_CONFIG_KEYS or config.get(key) == default:
            continue
        setattr(config, key, default)
        set_here.append(f"{key}={default}")
    if not set_here:
        return []
    method = config.objective if config.objective != "erm" else config.algorithm
    return [f"{method} on {config.dataset}: {', '.join(set_here)}, DomainBed's defaults for "
            "it there (--config.KEY=VALUE sets another)."]


def _given_keys(argv: Sequence[str]) -> list[str]:
    """The keys of the ``--config.KEY=VALUE`` (or ``--config.KEY VALUE``) words of ``argv``."""
    return [m.group(1) for a in argv[1:] if (m := re.match(r"--config\.([\w.]+)(=|$)", a))]


def _folder_test_envs_problem(config, root: str) -> str | None:
    """``config.test_envs`` against the domain folders of an image folder (the config's
    own check knows a published dataset's domains, not a researcher's folder)."""
    from sagm_jax.data import splits

    test_envs, domains = config.test_envs, splits.list_domains(root)
    field = next(f for f in config_lib.all_fields() if f.key == "test_envs")
    if field.check(test_envs, config, None) or not domains:
        return None  # reported by the config's check, or by the data's loader
    expected = config_lib.test_envs_problem(test_envs, config.dataset, domains)
    return f"config.test_envs={flag_value(test_envs)}: expected {expected}." if expected else None


def _workdir_problem(workdir: str) -> str | None:
    """Whether the run directory can be made and written, found by making (and removing)
    a probe folder holding a probe file in its nearest existing ancestor: permission bits
    say nothing of /proc, /sys or a read-only mount, where only the attempt fails. A
    workdir that did not exist is not left behind."""
    path = os.path.abspath(workdir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"--workdir={workdir}: {path} is a file, so the run directory cannot be made there."
    try:
        probe = tempfile.mkdtemp(prefix=".sagm_jax-probe-", dir=path)
        try:
            with open(os.path.join(probe, "probe"), "w") as handle:
                handle.write("probe")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as error:
        return (
            f"--workdir={workdir}: cannot create a folder and write a file in {path} "
            f"({error.strerror or error}); choose a directory you can write."
        )
    return None


def preflight(
    config: ml_collections.ConfigDict,
    workdir: str,
    argv: Sequence[str],
    device_count: int | None = None,
) -> None:
    """UsageError listing EVERYTHING that stops the run from starting (data and the
    layout of its folders, weights, values, a method's setting given for a method not in
    the run, a batch the devices cannot share, workdir), each with the flag that fixes
    it, and an example command. ``device_count`` bounds ``config.num_devices`` and
    shares the batch (None: not known yet). Settings that are likely slips but may be
    meant (:func:`sagm_jax.config.config_warnings`) are printed as warnings, before the
    problems."""
    for warning in config_lib.config_warnings(config):
        _say(f"{PROGRAM}: warning: {warning}")
    problems = _data_problems(config) + [p for p in [_workdir_problem(workdir)] if p]
    problems += config_lib.config_problems(config, device_count, check_files=True)
    problems += config_lib.unused_setting_problems(config, _given_keys(argv))
    problems += config_lib.device_batch_problems(config, device_count, _listed_domains(config))
    if not problems:
        return
    hints = value_suggestions(config, device_count)
    problems = [problem + hints.get(problem, "") for problem in problems]
    path = _config_path(argv[1:]) or "the config"
    lines = [f"{path} cannot start; {len(problems)} thing(s) to fix:"]
    lines += [
        textwrap.fill(
            p,
            100,
            initial_indent=f"  {i}. ",
            subsequent_indent="     ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for i, p in enumerate(problems, 1)
    ]
    lines += [
        f"The run directory would be {workdir} (--workdir=DIR chooses another).",
        "For example:",
        f"  {PROGRAM} {shlex.join(_example(config, workdir, argv, device_count))}",
    ]
    raise UsageError("\n".join(lines))


# A problem's own fix, where it names one: the --config.KEY=VALUE words after its "use".
_FIX = re.compile(r"\buse ((?:--config\.\w+=[^\s,;]+ ?)+)")


def _typed(value: str, like):
    """``value`` (a flag's text) as the type of the config value ``like``."""
    if isinstance(like, bool):
        return value == "True"
    return type(like)(value) if isinstance(like, (int, float, str)) else value


def _problem_fixes(config, device_count) -> dict[str, str]:
    """``{KEY: VALUE}`` of the ``use --config.KEY=VALUE`` fixes the config's problems name
    (a combination's: ``mixstyle=True`` on the MNIST CNN, an odd batch for crossdomain
    MixStyle, ``perturbation=per_device`` with an objective), applied in turn to a copy
    of the config, since one fix may raise another's problem (at most 3 rounds)."""
    fixes, candidate = {}, ml_collections.ConfigDict(config.to_dict())
    for _ in range(3):
        problems = config_lib.config_problems(candidate, device_count)
        problems += config_lib.device_batch_problems(
            candidate, device_count, _listed_domains(candidate)
        )
        found = {}
        for problem in problems:
            if match := _FIX.search(problem):
                for word in match.group(1).split():
                    key, value = word[len("--config.") :].split("=", 1)
                    found[key] = value.rstrip(".")
        found = {k: v for k, v in found.items() if k in candidate and fixes.get(k) != v}
        if not found:
            break
        for key, value in found.items():
            candidate[key] = _typed(value, candidate[key])
        fixes.update(found)
    return fixes


def _example(config, workdir: str, argv: Sequence[str], device_count) -> list[str]:
    """The user's arguments made a command that starts: without the overrides whose
    values failed their check (the config file's own values stand) or an unusable
    ``--workdir``, with the base config's value for a file's own invalid one, the fixes
    the problems name (:func:`_problem_fixes`), and placeholders for the missing data
    and weights."""
    fixes = _problem_fixes(config, device_count)
    invalid = {key for key, _ in config_lib.field_problems(config, device_count)} | set(fixes)
    invalid |= {k for k in _given_keys(argv) if config_lib.unused_setting_problems(config, [k])}
    data = _data_problems(config)
    # test_envs the data or the method cannot train with (EQRM's one environment): the
    # config file's stand.
    if any(p.startswith("config.test_envs=") for p in data + config_lib.method_problems(config)):
        invalid.add("test_envs")
    takes_none = getattr(BACKBONES.get(config.arch), "weights_file", None) is None
    if takes_none and config_lib.weights_problem(config):
        invalid.add("pretrained_weights")  # weights given to a network that takes none
    drop_workdir = _workdir_problem(workdir) is not None
    example, overridden, words = [], set(), iter(argv[1:])
    for arg in words:
        match = re.match(r"--config\.([\w.]+)(=|$)", arg)
        key = match.group(1) if match else None
        overridden.add(key)
        if key in invalid or (drop_workdir and arg.startswith("--workdir")):
            if (match and not match.group(2)) or arg == "--workdir":
                next(words, None)  # "--config.KEY VALUE", "--workdir DIR": its value too
            continue
        example.append(arg)
    defaults = config_lib.base_config()
    for key in sorted(invalid - overridden - set(fixes)):
        if key in defaults and config.get(key) != defaults[key]:
            example.append(f"--config.{key}={flag_value(defaults[key])}")
    example += [f"--config.{key}={value}" for key, value in fixes.items()]
    if data and not config.data_dir:
        example.append("--config.data_dir=DATA_DIR")
    if not config.pretrained_weights and config_lib.weights_problem(config):
        example.append(f"--config.pretrained_weights={BACKBONES[config.arch].weights_file}")
    return example


# --- around the run -----------------------------------------------------------------


def quiet_tensorflow_import() -> None:
    """Imports TensorFlow with the C++ start-up chatter it writes straight to file
    descriptor 2 (twice: oneDNN notices, CPU-feature notes) sent to /dev/null. A failing
    import still raises its Python exception, printed normally."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(null, 2)
        with contextlib.suppress(ImportError):
            import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def interrupted_message(workdir: str, argv: Sequence[str]) -> str:
    """Where the stopped run stands (its last evaluated step, per test environment with
    all_test_envs) and the command that resumes it."""
    steps = []
    for run in find_runs(workdir):
        if run.last_step is not None:
            name = os.path.relpath(run.path, workdir)
            steps.append(f"step {run.last_step}" + (f" in {name}" if name != "." else ""))
    kept = f" Last evaluation: {', '.join(steps)}." if steps else ""
    command = list(argv[1:])
    if not any(a.startswith("--workdir") for a in command):
        command.append(f"--workdir={workdir}")
    if not steps and not _holds_checkpoints(workdir):  # stopped during set-up
        return (
            f"Stopped before the first evaluation: {workdir} holds no checkpoint or records "
            f"yet. The same command starts the run from step 0:\n  {PROGRAM} {shlex.join(command)}"
        )
    return (
        f"Stopped. {workdir} keeps its checkpoints and records.{kept} Resume from the last "
        f"checkpoint with the same command:\n  {PROGRAM} {shlex.join(command)}"
    )


def _holds_checkpoints(workdir: str) -> bool:
    pattern = os.path.join(glob.escape(workdir), "**", CHECKPOINTS, "*")
    return bool(glob.glob(pattern, recursive=True))


def guarded(
    run: Callable[[], object], workdir: str, argv: Sequence[str], show_traceback: bool
) -> int:
    """Runs ``run()``; returns the exit status. A user error is one message on stderr
    (UsageError: 2; others: 1), Ctrl-C or SIGTERM says how to resume (130)."""
    try:
        run()
    except KeyboardInterrupt:
        _say("")
        _say(interrupted_message(workdir, argv))
        return INTERRUPTED
    except UsageError as error:
        _say(f"{PROGRAM}: {error}")
        return USAGE
    except USER_ERRORS as error:
        if show_traceback:
            raise
        _say(f"{PROGRAM}: error: {error}")
        _say("(--traceback shows where it was raised)")
        return FAILED
    return 0
