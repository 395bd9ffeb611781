"""A sweep packed (``launch --pack R``) against the same sweep one process per run.

    python experiments/packed_sweep.py [--pack 18] [--jobs 2] [--memory_packs 1 2 6 18]
        [--algorithms erm sagm] [--trial_seeds 0 1 2] [--workdir DIR] [--keep]

The sweep is ``configs/rotated_digits.py`` (its 301 steps, evaluations every 50) for
each update rule x the 6 test environments x the trial seeds: 36 runs with the
defaults. It is launched twice with ``--jobs J``, once unpacked and once with
``--pack R``, into two folders; the script prints each wall time and runs per hour,
their ratio (measured in one run: the machine's other load hits both), each part of
the packed processes' time (``sagm_jax.training.packed``'s phases, printed by each
pack), whether the two sweeps' records and ``collect_results`` tables agree, and then
the peak memory (max RSS of the pack's process) of a pack of R runs for each
``--memory_packs`` R (51 steps, one evaluation and checkpoint). Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(output_dir: str, grid: list[str], extra: list[str]) -> tuple[float, str]:
    """Runs the sweep launcher; returns its wall time and output."""
    command = [sys.executable, "-m", "sagm_jax.sweep", "launch", *grid,
               "--output_dir", output_dir, *extra]
    start = time.monotonic()
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if out.returncode:
        sys.exit(f"{' '.join(command)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return seconds, out.stdout


def pack_phases(output_dir: str) -> tuple[dict, float, float]:
    """The packs' phases summed, their processes' total and import times."""
    phases, total, imports = {}, 0.0, 0.0
    root = os.path.join(output_dir, "packs")
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name, "out.txt")) as f:
            text = f.read()
        for match in re.finditer(r"pack phases \(s\): (\{.*\})", text):
            for key, value in json.loads(match.group(1)).items():
                phases[key] = phases.get(key, 0.0) + value
        for match in re.finditer(r"pack process \(s\): ([\d.]+) in all, ([\d.]+) importing", text):
            total += float(match.group(1))
            imports += float(match.group(2))
    return phases, total, imports


def tables(output_dir: str) -> str:
    from sagm_jax.results.report import build_report

    report = build_report(output_dir, "training_domain", False, "±", False, False)
    return report.replace(output_dir, "DIR")


def compare(alone: str, packed: str) -> str:
    """How close the two sweeps' records and tables are."""
    from sagm_jax.training.rundir import read_records

    largest_acc = largest_loss = 0.0
    runs = identical = 0
    for name in sorted(os.listdir(alone)):
        if not os.path.exists(os.path.join(alone, name, "results.jsonl")):
            continue
        got = read_records(os.path.join(packed, name))
        want = read_records(os.path.join(alone, name))
        runs += 1
        same = True
        for g, w in zip(got, want, strict=True):
            for key in w:
                if key.endswith("_acc"):
                    largest_acc = max(largest_acc, abs(g[key] - w[key]))
                    same &= g[key] == w[key]
                elif key.endswith("_loss") or key == "loss":
                    largest_loss = max(largest_loss, abs(g[key] / w[key] - 1))
                    same &= g[key] == w[key]
        identical += same
    numbers = re.compile(r"\d+\.\d")
    got, want = tables(packed), tables(alone)
    cells = [abs(float(g) - float(w)) for g, w in zip(numbers.findall(got), numbers.findall(want))]
    return (
        f"{runs} runs: {identical} with identical records; largest accuracy difference "
        f"{largest_acc:.4f}, largest relative loss difference {largest_loss:.1e}; tables "
        + ("identical" if got == want else f"differ by at most {max(cells):.1f} points")
    )


def peak_memory(workdir: str, runs: int, algorithm: str) -> float:
    """Max RSS (GiB) of the process of a pack of ``runs`` runs (51 steps)."""
    envs = [str(e) for e in range(min(runs, 6))]
    trials = [str(t) for t in range((runs + 5) // 6)]
    grid = ["--datasets", "RotatedDigits", "--algorithms", algorithm, "--test_envs", *envs,
            "--trial_seeds", *trials, "--set", "steps=51", "--set", "eval_every=50"]
    output_dir = os.path.join(workdir, f"memory{runs}")
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    # A pack of exactly `runs`: the first `runs` jobs of the grid (test environments first).
    command = [sys.executable, "-m", "sagm_jax.sweep", "launch", *grid,
               "--output_dir", output_dir, "--pack", str(runs)]
    out = subprocess.run([sys.executable, "-c", probe, *command], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=int, default=18)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--algorithms", nargs="+", default=["erm", "sagm"])
    parser.add_argument("--trial_seeds", nargs="+", default=["0", "1", "2"])
    parser.add_argument("--memory_packs", nargs="*", type=int, default=[1, 2, 6, 18])
    parser.add_argument("--set", nargs="*", default=[], help="--set KEY=VALUE for every run "
                        "(e.g. steps=21 for a quick check of the script).")
    parser.add_argument("--workdir", help="Where the sweeps go (default: a temporary folder).")
    parser.add_argument("--keep", action="store_true", help="Keep the sweeps' folders.")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="packed-sweep-")
    grid = ["--datasets", "RotatedDigits", "--algorithms", *args.algorithms,
            "--test_envs", "all", "--trial_seeds", *args.trial_seeds]
    for item in args.set:
        grid += ["--set", item]
    runs = 6 * len(args.algorithms) * len(args.trial_seeds)
    alone, packed = os.path.join(workdir, "alone"), os.path.join(workdir, "packed")
    print(f"# {runs} runs of configs/rotated_digits.py, --jobs {args.jobs}\n")
    t_alone, _ = launch(alone, grid, ["--jobs", str(args.jobs)])
    t_packed, out = launch(packed, grid, ["--jobs", str(args.jobs), "--pack", str(args.pack)])
    print("| launch | wall | runs per hour |\n|---|---|---|")
    print(f"| one process per run | {t_alone:.0f} s | {runs * 3600 / t_alone:.0f} |")
    print(f"| --pack {args.pack} | {t_packed:.0f} s | {runs * 3600 / t_packed:.0f} |")
    print(f"\nPacked / unpacked runs per hour: {t_alone / t_packed:.2f}x\n")
    print("Grouping:\n" + "\n".join(line for line in out.splitlines() if line.startswith("  ")))
    phases, total, imports = pack_phases(packed)
    n_packs = len(os.listdir(os.path.join(packed, "packs")))
    print(f"\nThe packs' processes, summed over the {n_packs} packs ({total:.0f} s):\n\n| part | s | share |\n|---|---|---|")
    parts = {"Python, imports, configs": imports, **phases}
    parts["other (summaries, exit)"] = total - sum(parts.values())
    for key, value in parts.items():
        print(f"| {key} | {value:.1f} | {value / total:.0%} |")
    print("\nAgreement: " + compare(alone, packed))
    if args.memory_packs:
        print(f"\nPeak memory of a pack's process ({args.algorithms[-1]}, 51 steps):\n")
        print("| R | max RSS (GiB) |\n|---|---|")
        for r in args.memory_packs:
            print(f"| {r} | {peak_memory(workdir, r, args.algorithms[-1]):.2f} |", flush=True)
    if not args.keep and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
