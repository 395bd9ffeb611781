"""``python -m sagm_jax.collect_results``: the result tables' command, kept at this name
for DomainBed users; the tables live in :mod:`sagm_jax.results`."""

from sagm_jax.results.collect import main

if __name__ == "__main__":
    raise SystemExit(main())
