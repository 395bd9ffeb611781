"""XLA options the package sets for CPU runs (issue 12: the CPU step against PyTorch).

This module owns the XLA flags that sagm_jax adds for its CPU runs. XLA reads
``XLA_FLAGS`` once, when JAX starts its backend, so ``configure()`` must run
before the first JAX computation; later it changes nothing and says so.

The one flag kept, measured on the 2-core development CPU (jax 0.10.2):

  --xla_cpu_enable_concurrency_optimized_scheduler=false
      XLA's CPU default schedules the step's operations to run side by side,
      which keeps many activations alive at once. The memory-minimising schedule
      cuts the ResNet-50 SAGM step's temporary buffers (224x224, batch 24) from
      3.5 to 2.4 GB and the process's peak RSS from 5.4 to 4.1 GB, for about 2-3%
      of step time; the results are bit-identical (only the order of independent
      operations changes). It is a CPU-only option; other backends ignore it.

Flags measured and not kept (no gain on any convolution of the ResNets, see the
README's Performance section): ``--xla_cpu_use_onednn`` and
``--xla_cpu_experimental_onednn_custom_call`` (no effect: this jaxlib is built
without oneDNN), ``--xla_cpu_use_xnnpack`` (already on), YNNPACK convolutions
(``--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution``),
``--xla_cpu_use_thunk_runtime=false`` (deprecated, slower),
``--xla_cpu_multi_thread_eigen=false`` (slower).
"""

from __future__ import annotations

import os
import warnings

CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def _backend_started() -> bool:
    import sys

    if "jax" not in sys.modules:  # nothing can have started it
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def configure() -> list[str]:
    """Adds ``CPU_FLAGS`` to ``XLA_FLAGS`` (a flag the user already set is left alone).

    Returns the flags added. Call it before JAX starts its backend; after that it
    warns and adds nothing, since XLA would not read them.
    """
    current = os.environ.get("XLA_FLAGS", "")
    names = {flag.split("=", 1)[0] for flag in current.split()}
    missing = [flag for flag in CPU_FLAGS if flag.split("=", 1)[0] not in names]
    if not missing:
        return []
    if _backend_started():
        warnings.warn(
            "sagm_jax.cpu.configure() called after JAX started its backend; "
            f"XLA will not read {' '.join(missing)}",
            stacklevel=2,
        )
        return []
    os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()
    return missing
