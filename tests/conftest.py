"""Test set-up: eight fake CPU devices, so sharding tests run without accelerators.

XLA reads the flag once, when the backend starts, so it is set before anything
imports jax. Tests that need one device build a one-device mesh explicitly.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
