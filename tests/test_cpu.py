"""sagm_jax.cpu: its flags reach XLA (smaller step buffers, same numbers), respect the user."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sagm_jax import cpu

# ResNet-50's gradient at 32x32 (batch 4): the smallest step where the schedule matters.
# Its weights are drawn in NumPy (models.synthetic, He scale): compiling model.init took
# more than half of each process's time.
SCRIPT = """
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
from sagm_jax import models
from sagm_jax.models.synthetic import draw_torchvision_weights
model = models.create("resnet50", 7)
x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32, 32, 3)), jnp.float32)
variables = models.convert_torchvision(draw_torchvision_weights("resnet50", 0, num_classes=7))
loss = lambda p, s, x: jnp.mean(model.apply({"params": p, "batch_stats": s}, x, train=True) ** 2)
compiled = jax.jit(jax.grad(loss)).lower(variables["params"], variables["batch_stats"], x).compile()
grads = jax.tree.leaves(compiled(variables["params"], variables["batch_stats"], x))
np.savez(sys.argv[1], *[np.asarray(g) for g in grads])
digest = hashlib.sha256(b"".join(np.asarray(g).tobytes() for g in grads))
temp = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps({"temp": temp, "grads": digest.hexdigest()}))
"""


def _run(tmp_path, name, flags):
    """The script in a fresh process whose XLA_FLAGS are exactly ``flags``."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    path = str(tmp_path / f"{name}.npz")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, path], capture_output=True, text=True, env=env, check=True
    )
    with np.load(path) as grads:
        return json.loads(out.stdout.strip().splitlines()[-1]), [grads[k] for k in grads.files]


def test_the_schedule_flag_shrinks_the_buffers_and_all_flags_change_only_rounding(tmp_path):
    """Against one run without flags: the schedule flag alone shrinks the step's buffers
    and keeps its gradient bit for bit; all the flags change it by float rounding only."""
    plain, plain_grads = _run(tmp_path, "plain", [])
    scheduled, _ = _run(tmp_path, "s", cpu.CPU_FLAGS[:1])
    assert scheduled["temp"] < 0.8 * plain["temp"], (plain, scheduled)
    assert scheduled["grads"] == plain["grads"]  # bit-identical: only the schedule changed
    _, configured = _run(tmp_path, "c", cpu.CPU_FLAGS)
    assert len(plain_grads) == len(configured) == 161  # every parameter of ResNet-50 and its head
    for expected, got in zip(plain_grads, configured):
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * scale)


FUSIONS_SCRIPT = """
import json
import jax, jax.numpy as jnp
x, w, m = jnp.ones((8, 8, 8, 64)), jnp.ones((3, 3, 64, 64)), jnp.ones((64, 64))
programs = {
    "convolution": (lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), x, w),
    "reduce": (lambda x: jnp.sum(x, axis=(0, 1, 2)), x),
    "dot": (lambda a, m: a @ m, x.reshape(-1, 64), m),
}
hlo = {name: jax.jit(f).lower(*args).compile().as_text() for name, (f, *args) in programs.items()}
print(json.dumps(sorted(name for name, text in hlo.items() if "__ynn_fusion" in text)))
"""


def _ynn_operations(flags):
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    out = subprocess.run(
        [sys.executable, "-c", FUSIONS_SCRIPT], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reductions_go_to_ynnpack_and_convolutions_and_dots_stay_with_xla():
    """The fusion-type flag reaches XLA: compiled alone, a column sum (BatchNorm's bias
    gradient) is a YNNPACK fusion, a 3x3 convolution and a dot are XLA's own (by default
    YNNPACK takes the convolution)."""
    assert _ynn_operations(cpu.CPU_FLAGS) == ["reduce"]
    assert "convolution" in _ynn_operations([])


def test_configure_adds_missing_flags_once_and_keeps_the_users(monkeypatch):
    monkeypatch.setattr(cpu, "_backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert cpu.configure() == list(cpu.CPU_FLAGS)
    expected = ["--xla_force_host_platform_device_count=8", *cpu.CPU_FLAGS]
    assert os.environ["XLA_FLAGS"].split() == expected
    assert cpu.configure() == []  # idempotent
    user = "--xla_cpu_enable_concurrency_optimized_scheduler=true"  # the user's own value
    monkeypatch.setenv("XLA_FLAGS", user)
    assert cpu.configure() == list(cpu.CPU_FLAGS[1:])  # only the flags the user did not set
    assert os.environ["XLA_FLAGS"].split() == [user, *cpu.CPU_FLAGS[1:]]


def test_configure_after_the_backend_started_warns_and_changes_nothing(monkeypatch):
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # the backend is up
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.warns(UserWarning, match="after JAX started"):
        assert cpu.configure() == []
    assert "XLA_FLAGS" not in os.environ
