"""One training run: the train state and step (``train_step``), the program that
loops over it (``train``), evaluation (``evaluation``), checkpoints
(``checkpoints``) and the run directory's files (``rundir``)."""
