"""Weight averaging, within a run and across runs: the one home of every method that
averages weights or ensembles predictions.

Within a run (kept on the device in the train state, updated inside the jitted step):
  valley          SWAD's loss valley (Cha et al., NeurIPS 2021): which segments average
  swad_averages   SWAD's segment, window and final means
  swad            SWAD in a run: the valley driving the averages, the final model
  moving_average  a run's simple moving average of its weights (EoA's, DiWA's MA, ERM++'s)
Across runs (from finished run directories, or a pack's runs at the end of training):
see the modules listed in docs/averaging.md.
"""
