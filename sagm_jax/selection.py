"""Model selection: pure functions from evaluation records to the chosen record.

A record is one line of results.jsonl: ``step`` and ``env{i}_{part}_acc``.
"""

from __future__ import annotations

import numpy as np


def training_domain_validation(records: list[dict], test_envs) -> dict:
  """The record whose mean ``out`` accuracy over the TRAINING environments is highest.

  The earliest such record wins a tie. Returns its ``step``, every
  ``env{i}_{part}_acc`` and ``validation_acc`` (the mean that chose it).
  """
  if not records:
    raise ValueError("training_domain_validation: no records to select from.")
  test_envs = {int(e) for e in test_envs}
  envs = sorted({int(k[3:].split("_")[0]) for k in records[0] if k.startswith("env")
                 and k.endswith("_out_acc")})
  train_envs = [e for e in envs if e not in test_envs]
  if not train_envs:
    raise ValueError(f"training_domain_validation: test_envs {sorted(test_envs)} leave no "
                     "training environment in the records.")
  scores = [float(np.mean([r[f"env{e}_out_acc"] for e in train_envs])) for r in records]
  chosen = records[int(np.argmax(scores))]
  return {"step": chosen["step"], "validation_acc": max(scores),
          **{k: v for k, v in chosen.items() if k.startswith("env") and k.endswith("_acc")}}
