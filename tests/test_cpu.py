"""sagm_jax.cpu: its flags reach XLA (smaller step buffers, same numbers), respect the user."""

import json
import os
import subprocess
import sys

import pytest

from sagm_jax import cpu

# ResNet-50's gradient at 32x32 (batch 4): the smallest step where the schedule matters.
SCRIPT = """
import hashlib, json, sys
if sys.argv[1] == "configure":
    import sagm_jax.cpu
    sagm_jax.cpu.configure()
import jax, jax.numpy as jnp, numpy as np
from sagm_jax import models
model = models.create("resnet50", 7)
x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, 32, 3)), jnp.float32)
variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(x)
loss = lambda p, s, x: jnp.mean(model.apply({"params": p, "batch_stats": s}, x, train=True) ** 2)
compiled = jax.jit(jax.grad(loss)).lower(variables["params"], variables["batch_stats"], x).compile()
grads = compiled(variables["params"], variables["batch_stats"], x)
digest = hashlib.sha256(b"".join(np.asarray(g).tobytes() for g in jax.tree.leaves(grads)))
temp = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps({"temp": temp, "grads": digest.hexdigest()}))
"""


def _run(mode):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flags_shrink_the_step_buffers_and_keep_its_numbers():
    plain, configured = _run("plain"), _run("configure")
    assert configured["temp"] < 0.8 * plain["temp"], (plain, configured)
    assert configured["grads"] == plain["grads"]  # bit-identical: only the schedule changed


def test_configure_adds_missing_flags_once_and_keeps_the_users(monkeypatch):
    monkeypatch.setattr(cpu, "_backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert cpu.configure() == list(cpu.CPU_FLAGS)
    expected = ["--xla_force_host_platform_device_count=8", *cpu.CPU_FLAGS]
    assert os.environ["XLA_FLAGS"].split() == expected
    assert cpu.configure() == []  # idempotent
    user = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.setenv("XLA_FLAGS", user)
    assert cpu.configure() == []
    assert os.environ["XLA_FLAGS"] == user


def test_configure_after_the_backend_started_warns_and_changes_nothing(monkeypatch):
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # the backend is up
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.warns(UserWarning, match="after JAX started"):
        assert cpu.configure() == []
    assert "XLA_FLAGS" not in os.environ
