"""``python -m sagm_jax.sharpness_curves``: Figure 3 from finished runs; the command
lives in :mod:`sagm_jax.results.sharpness_curves`."""

from sagm_jax.results.sharpness_curves import main

if __name__ == "__main__":
    raise SystemExit(main())
