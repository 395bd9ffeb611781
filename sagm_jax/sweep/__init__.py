"""Sweeps: a grid of training jobs, each run exactly once (``python -m sagm_jax.sweep``).

  jobs        the job grid: arguments, directories, commands, status
  launchers   local processes and submitit (SLURM) job arrays, exactly once
  __main__    the command line: ``launch``, ``status``, ``delete_incomplete``
"""
