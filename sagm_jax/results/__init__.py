"""What a sweep's records become: model selection (``selection``), the result tables
(``collect``, ``python -m sagm_jax.collect_results``), the sharpness measure
(``sharpness``) and its curves (``sharpness_curves``)."""
