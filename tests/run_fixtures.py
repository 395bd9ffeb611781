"""The tiny training runs the tests make: RotatedDigits with a small CNN, seconds each."""

from sagm_jax.config import mnist_config


def digits_config(**overrides):
    config = mnist_config("RotatedDigits")
    config.update(
        dict(
            batch_per_env=8,
            steps=5,
            eval_every=2,
            log_every=1,
            eval_batch_size=64,
            cnn_widths=(16, 32, 32, 32),
        )
    )
    config.update(overrides)
    return config
