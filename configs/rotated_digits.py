"""The offline default: SAGM on RotatedDigits (scikit-learn's digits in six rotations).

DomainBed's MNIST settings, with a smaller batch and fewer steps so that it runs
in a few minutes on a laptop CPU.
"""
from sagm_jax.config import mnist_config


def get_config():
  config = mnist_config("RotatedDigits")
  config.test_envs = (0,)
  config.batch_per_env = 16
  config.steps = 301
  config.eval_every = 50
  return config
