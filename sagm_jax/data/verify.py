"""``python -m sagm_jax.data.verify --dataset=PACS --data_dir=DIR``: check a download.

Opens the dataset as training would (layout checks and the decode check of every
file), prints the images per domain and class, and compares them with the published
counts in the registry (domains, number of classes, per-domain counts where known,
total). Exits 0 when everything matches, 1 on a mismatch, 2 when the dataset cannot
be opened. DomainNet's published total is before DomainBed removes its listed
duplicates, so a DomainBed download may have fewer: its total only may not exceed it.
"""

from __future__ import annotations

import argparse
import sys

from sagm_jax.data import image_folder, registry


def compare(spec: registry.DatasetSpec, fingerprint: dict) -> list[str]:
    """The mismatches between a dataset's fingerprint and its published counts."""
    problems = []
    domain_totals = fingerprint["domain_totals"]
    if spec.domains is not None and tuple(domain_totals) != spec.domains:
        problems.append(f"domains {list(domain_totals)} != published {list(spec.domains)}")
    n_classes = len(next(iter(fingerprint["counts"].values()), {}))
    if spec.num_classes is not None and n_classes != spec.num_classes:
        problems.append(f"{n_classes} classes != published {spec.num_classes}")
    for domain, expected in (spec.domain_totals or {}).items():
        found = domain_totals.get(domain)
        if found != expected:
            problems.append(f"domain {domain!r}: {found} images != published {expected}")
    if spec.total is not None:
        total = fingerprint["total"]
        if spec.name == "DomainNet" and total > spec.total:
            problems.append(f"{total} images > published {spec.total} (before duplicate removal)")
        elif spec.name != "DomainNet" and total != spec.total:
            problems.append(f"{total} images != published {spec.total}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help=f"one of {sorted(registry.DATASETS)}")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument(
        "--skip_bad_files",
        action="store_true",
        help="report undecodable files and go on, instead of failing",
    )
    parser.add_argument("--no_cache", action="store_true", help="re-check every file")
    args = parser.parse_args(argv)
    spec = registry.get_spec(args.dataset)
    if spec.kind != "folder":
        parser.error(f"{args.dataset} is built in memory; verify checks image folders")
    try:
        ds = registry.load(
            args.dataset,
            args.data_dir,
            trial_seed=0,
            skip_bad_files=args.skip_bad_files,
            cache_dir=None if args.no_cache else "default",
            check_layout=False,  # print what is there, then every difference
            open_images=None,  # the files' counts only: no batches, no TensorFlow
        )
    except (
        image_folder.DatasetNotFoundError,
        image_folder.DatasetLayoutError,
        image_folder.BadImageError,
    ) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 2
    fp = ds.fingerprint
    width = max(len(c) for c in ds.class_names)
    for domain, counts in fp["counts"].items():
        print(f"{domain}: {fp['domain_totals'][domain]} images")
        for cls, n in counts.items():
            print(f"  {cls:<{width}} {n}")
    print(
        f"total: {fp['total']} images, {len(ds.class_names)} classes, "
        f"files sha256 {fp['files_sha256']}"
    )
    if ds.skipped:
        print(f"skipped {len(ds.skipped)} undecodable file(s):")
        for s in ds.skipped:
            print(f"  {s['path']}: {s['reason']}")
    problems = compare(spec, fp)
    for p in problems:
        print(f"MISMATCH: {p}")
    if not problems:
        print(f"OK: matches the published counts of {spec.name}" if spec.total else "OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
