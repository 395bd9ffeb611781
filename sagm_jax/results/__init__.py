"""What a sweep's records become: model selection (``selection``); the result tables,
from reading the records (``records``) to statistics and rendering (``tables``), the
report and its notes (``report``), the ``--winners``/``--top_hparams`` listings
(``listings``) and the command line (``collect``, ``python -m sagm_jax.collect_results``);
the sharpness measure (``sharpness``) and its curves (``sharpness_curves``)."""
