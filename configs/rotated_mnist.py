"""SAGM on RotatedMNIST with DomainBed's MNIST settings. MNIST comes through
tensorflow-datasets (`tfds.load('mnist')` downloads it once, with internet).
"""

from sagm_jax.config import mnist_config


def get_config():
    config = mnist_config("RotatedMNIST")
    config.test_envs = (0,)
    return config
