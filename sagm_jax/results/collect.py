"""Results tables of a sweep: reads every run under a folder (``rundir.find_runs``),
selects models (``sagm_jax.results.selection``) and prints the paper's tables in Markdown or LaTeX.

    python -m sagm_jax.collect_results --input_dir sweeps/digits \
        [--selection training_domain|leave_one_out|oracle_last|oracle_best] \
        [--latex] [--pm +/-] [--winners] [--strict] [--output FILE]
    python -m sagm_jax.collect_results --top_hparams --input_dir sweeps/digits \
        --dataset RotatedDigits --algorithm "SAGM + CORAL" --test_env 0

The parts: ``records`` (reading and grouping runs), ``tables`` (statistics and
rendering), ``report`` (the whole report and its notes), ``listings`` (``--winners``,
``--top_hparams``), all in ``sagm_jax.results``.
"""

from __future__ import annotations

import argparse
import sys

from sagm_jax.results import selection

# The names the tests and other modules reach as ``collect.<name>``.
from sagm_jax.results.listings import top_hparams, varying_keys, winner_text  # noqa: F401
from sagm_jax.results.records import (  # noqa: F401
    group_runs,
    load_runs,
    method_name,
    select,
    setting_key,
)
from sagm_jax.results.report import build_report  # noqa: F401
from sagm_jax.results.tables import (  # noqa: F401
    ABLATION_ALGORITHMS,
    HEAD_ORDER,
    PLUS_MINUS,
    ROW_ORDER,
    TABLE_2_ROWS,
    TABLE_2_OBJECTIVES,
    dataset_table,
    format_cell,
    mean_and_se,
    method_order,
    significance_arrow,
)
from sagm_jax.data.registry import PAPER_DATASETS  # noqa: F401


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sagm_jax.collect_results", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--input_dir", required=True, help="A sweep's output folder.")
    parser.add_argument(
        "--selection",
        default="training_domain",
        help=f"One of {', '.join(selection.RUN_SELECTIONS)}.",
    )
    parser.add_argument("--latex", action="store_true", help="LaTeX tables instead of Markdown.")
    parser.add_argument(
        "--pm",
        choices=PLUS_MINUS,
        default=PLUS_MINUS[0],
        help="The sign between mean and standard error; '+/-' is DomainBed's style.",
    )
    parser.add_argument(
        "--winners",
        action="store_true",
        help="After the tables, per dataset, the setting that each cell chose: its "
        "hyperparameters that vary within the cell and its folder.",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="Refuse to report when a run is damaged (a lost or repeated record, records "
        "of neither kind, two runs with the same config and test environments) instead "
        "of leaving it out and naming it in the notes.",
    )
    top = parser.add_argument_group("--top_hparams (instead of the tables)")
    top.add_argument(
        "--top_hparams",
        action="store_true",
        help="Rank every setting of --dataset, --algorithm and --test_env under each "
        "selection and trial seed, as DomainBed's list_top_hparams does.",
    )
    top.add_argument("--dataset", help="A dataset of the sweep (PACS).")
    top.add_argument(
        "--algorithm",
        help='A row label of the tables ("SAGM + CORAL", "SAGM + SWAD", "ERM (DomainBed)"), '
        'or a recorded algorithm name (config.algorithm "sagm", DomainBed\'s "ERM"): a '
        "name ranks each row of its runs separately.",
    )
    top.add_argument("--test_env", type=int, help="The held-out environment's index.")
    parser.add_argument("--output", help="Write the report to this file (default: stdout).")
    return parser


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    top_args = (args.dataset, args.algorithm, args.test_env)
    if args.top_hparams and None in top_args:
        parser.error("--top_hparams needs --dataset, --algorithm and --test_env.")
    if not args.top_hparams and top_args != (None, None, None):
        parser.error("--dataset, --algorithm and --test_env go with --top_hparams.")
    try:
        if args.top_hparams:
            report = top_hparams(args.input_dir, *top_args, strict=args.strict)
        else:
            report = build_report(
                args.input_dir, args.selection, args.latex, args.pm, args.winners, args.strict
            )
    except (FileNotFoundError, ValueError) as error:
        print(f"collect_results: {error}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(report)
    else:
        sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
