"""Experiment scripts: the sweep launcher (``sweep.py``), the results tables
(``collect_results.py``) and the benchmarks (``bench_*.py``). A package so that
tests import their pure functions."""
