"""The offline default: SAGM on RotatedDigits (scikit-learn's digits in six rotations).

DomainBed's MNIST settings (lr 1e-3, no weight decay, SAGM's rho and alpha) on
a quarter-width MNIST CNN (16-32-32-32 instead of 64-128-128-128), with a
smaller batch and fewer steps, so that it runs in a few minutes on a laptop CPU.
`--config.cnn_widths=64,128,128,128` gives DomainBed's network. A preset after a colon
(sagm_jax.config.presets): erm_plusplus.
"""

from sagm_jax.config import mnist_config, presets


def get_config(preset=None):
    config = mnist_config("RotatedDigits")
    config.test_envs = (0,)
    config.cnn_widths = (16, 32, 32, 32)
    config.batch_per_env = 16
    config.steps = 301
    config.eval_every = 50
    return presets.apply(config, preset)  # configs/rotated_digits.py:erm_plusplus
