"""A population as one packed program against M separate processes, and its soup against M.

    python experiments/bench_population.py --members 2 4 8 --steps 101 --out /tmp/bench_pop

For each M: the members of a DiWA population of SAGM runs on RotatedDigits
(``configs/rotated_digits.py`` with ``--steps``; DiWA's mild hyperparameters, every
member from one linear-probed start, trained once beforehand and not timed) are trained

* as one packed program (``averaging.population.train_members``, the pack of M, in this
  process after one warm-up pack, so the figure is the program's and not this process's
  start-up), and
* as M separate processes, ``python -m sagm_jax.main`` each with the member's values
  (``--config.lr`` ... ``--config.init_from``), one after the other: each pays its start,
  its data and its compilation, as a sweep of separate jobs does;

and the runs per hour of each are printed. Then the uniform soup of the M packed members
is made in a process of its own (``python -m sagm_jax.averaging.soups``), whose wall time
and peak resident memory (``/usr/bin/time``'s maximum RSS) are printed with the bytes of
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


def file_config():
    """configs/rotated_digits.py's config, as ``python -m sagm_jax.main`` reads it."""
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import rotated_digits

    return rotated_digits.get_config()


def base(steps: int):
    config = file_config()
    config.steps, config.eval_every = steps, max(1, steps // 2)
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
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - start, done.stderr


def peak_rss_mib(stderr: str) -> float:
    line = next(x for x in stderr.splitlines() if x.startswith("PEAK_KB "))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=101)
    parser.add_argument("--out", default="/tmp/bench_population")
    args = parser.parse_args()
    from sagm_jax import cpu

    cpu.configure()
    from sagm_jax.averaging import population
    from sagm_jax.training import train
    import jax
    import numpy as np

    shutil.rmtree(args.out, ignore_errors=True)
    config = base(args.steps)
    start = os.path.join(args.out, "init")
    train.train_one_run(population.probe_config(config, args.steps), start)
    print(f"\nRotatedDigits, SAGM, {args.steps} steps per member, {jax.device_count()} "
          f"device(s) of {jax.devices()[0].platform}; a DiWA population from one probe.\n")
    rows = ["| M | packed (s) | runs/h packed | separate (s) | runs/h separate | ratio | "
            "soup (s) | soup peak RSS (MiB) | one member (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    warm = [population.member_config(config, "diwa", k, "diwa", start, None) for k in (1, 2)]
    population.train_members(warm, [os.path.join(args.out, "warm", str(k)) for k in (1, 2)], 2)
    for m in args.members:
        folder = os.path.join(args.out, f"M{m}")
        configs = [population.member_config(config, "diwa", k, "diwa", start, None)
                   for k in range(1, m + 1)]
        dirs = [os.path.join(folder, "packed", f"member{k}") for k in range(1, m + 1)]
        began = time.monotonic()
        population.train_members(configs, dirs, m)
        packed_s = time.monotonic() - began
        separate_s = 0.0
        for k, member in enumerate(configs, 1):
            command = [sys.executable, "-m", "sagm_jax.main",
                       "--config=configs/rotated_digits.py",
                       f"--workdir={os.path.join(folder, 'separate', f'member{k}')}",
                       *overrides(member, file_config())]
            separate_s += timed(command)[0]
        soup_dir = os.path.join(folder, "soup")
        soup_s, err = timed(["/usr/bin/time", "-f", "PEAK_KB %M", sys.executable, "-m",
                             "sagm_jax.averaging.soups", "--out", soup_dir, *dirs])
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
