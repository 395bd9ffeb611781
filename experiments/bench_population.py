"""A population as one packed program against M separate processes, and its soup against M.

    python experiments/bench_population.py --members 2 4 8 --steps 101 --out /tmp/bench_pop
    python experiments/bench_population.py --model resnet50 --members 2 4 8 --steps 101  # a GPU

For each M: the members of a DiWA population of SAGM runs (DiWA's mild hyperparameters,
every member from one linear-probed start, trained once beforehand and not timed) are
trained, on RotatedDigits (``--model digits``: ``configs/rotated_digits.py`` with
``--steps``) or on a PACS-like folder of random 227x227 JPEGs that the script writes
(``--model resnet50``: ``configs/pacs.py``'s ResNet-50 and SAGM, random weights,
``--image_size``, 32 images per domain and step, environment 3 held out; no
TensorFlow needed),

* as one packed program (``averaging.population.train_members``, the pack of M, in this
  process after one warm-up pack, so the figure is the program's and not this process's
  start-up), and
* as M separate processes, ``python -m sagm_jax.main`` each with the member's values
  (``--config.lr`` ... ``--config.init_from``), one after the other: each pays its start,
  its data and its compilation, as a sweep of separate jobs does;

and the runs per hour of each are printed. Then the uniform soup of the M packed members
is made in a process of its own (``python -m sagm_jax.averaging.soups``), whose wall time
and peak resident memory (its ``ru_maxrss``) are printed with the bytes of
one member's variables: the soup streams its members (one in memory at a time), so its
peak should not grow with M. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CONFIG_FILES = {"digits": "configs/rotated_digits.py", "resnet50": "configs/pacs.py"}


def file_config(model: str):
    """The model's config file's config, as ``python -m sagm_jax.main`` reads it."""
    from sagm_jax import cli

    return cli.load_config_file(os.path.join(ROOT, CONFIG_FILES[model]))


def base(args):
    """The population's config; for ``resnet50`` also the folder it writes."""
    config = file_config(args.model)
    config.steps, config.eval_every = args.steps, max(1, args.steps // 2)
    if args.model == "resnet50":
        sys.path.insert(0, os.path.join(ROOT, "experiments"))
        import bench_input

        folder = os.path.join(args.out, "data")
        bench_input.write_tree(folder, 227, 227, args.images_per_class)
        config.update(dataset="ImageFolder", data_dir=folder, pretrained_weights="none",
                      image_size=args.image_size, test_envs=(3,),
                      cache_dir=os.path.join(args.out, "cache"), batch_per_env=32)
    return config


def overrides(member, config) -> list[str]:
    """The ``--config.key=value`` flags that make ``config`` the member's config."""
    flags = []
    for key, value in member.to_dict().items():
        if value != config.to_dict().get(key):
            text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
            flags.append(f"--config.{key}={text}")
    return flags


def timed(command: list[str], env=None) -> tuple[float, str]:
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - start, done.stderr


# ``python -m sagm_jax.averaging.soups`` that prints its peak resident memory at exit.
SOUP_WITH_PEAK = (
    "import resource, runpy, sys\n"
    "sys.argv = ['soups'] + sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_module('sagm_jax.averaging.soups', run_name='__main__')\n"
    "finally:\n"
    "    print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
)


def peak_rss_mib(stderr: str) -> float:
    line = next(x for x in stderr.splitlines() if x.startswith("PEAK_KB "))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=101)
    parser.add_argument("--out", default="/tmp/bench_population")
    parser.add_argument("--model", choices=tuple(CONFIG_FILES), default="digits")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--images_per_class", type=int, default=20)
    args = parser.parse_args()
    from sagm_jax import cpu

    cpu.configure()
    import jax
    import numpy as np

    from sagm_jax.averaging import population
    from sagm_jax.training import train

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    config = base(args)
    keep = ("batch_per_env",)
    start = os.path.join(args.out, "init")
    train.train_one_run(population.probe_config(config, args.steps), start)
    print(f"\n{args.model}, SAGM, {args.steps} steps per member, {jax.device_count()} "
          f"device(s) of {jax.devices()[0].platform}; a DiWA population from one probe.\n")
    rows = [("| M | packed (s) | runs/h packed | separate (s) | runs/h separate | ratio | "
             "soup (s) | soup peak RSS (MiB) | one member (MiB) |"),
            "|---|---|---|---|---|---|---|---|---|"]
    warm = [population.member_config(config, "diwa", k, "diwa", start, None, keep)
            for k in (1, 2)]
    population.train_members(warm, [os.path.join(args.out, "warm", str(k)) for k in (1, 2)], 2)
    for m in args.members:
        folder = os.path.join(args.out, f"M{m}")
        configs = [population.member_config(config, "diwa", k, "diwa", start, None, keep)
                   for k in range(1, m + 1)]
        dirs = [os.path.join(folder, "packed", f"member{k}") for k in range(1, m + 1)]
        began = time.monotonic()
        population.train_members(configs, dirs, m)
        packed_s = time.monotonic() - began
        separate_s = 0.0
        for k, member in enumerate(configs, 1):
            command = [sys.executable, "-m", "sagm_jax.main",
                       f"--config={CONFIG_FILES[args.model]}",
                       f"--workdir={os.path.join(folder, 'separate', f'member{k}')}",
                       *overrides(member, file_config(args.model))]
            separate_s += timed(command)[0]
        soup_dir = os.path.join(folder, "soup")
        soup_s, err = timed([sys.executable, "-c", SOUP_WITH_PEAK, "--out", soup_dir, *dirs])
        variables = train.open_run(configs[0])[1]
        member_mib = sum(np.asarray(x).nbytes for x in jax.tree.leaves(variables)) / 2**20
        rows.append(
            f"| {m} | {packed_s:.1f} | {3600 * m / packed_s:.0f} | {separate_s:.1f} | "
            f"{3600 * m / separate_s:.0f} | {separate_s / packed_s:.2f}x | {soup_s:.1f} | "
            f"{peak_rss_mib(err):.0f} | {member_mib:.2f} |"
        )
        print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
