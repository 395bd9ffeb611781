"""One training run: the train state and step (``train_step``), the program that
loops over it (``train``), evaluation (``evaluation``), checkpoints (``checkpoints``),
the run directory's files (``rundir``), the summary a run prints (``summary``) and
reading a finished run back (``loading``: ``load_run``, ``preprocess``)."""
