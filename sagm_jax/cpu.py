"""XLA options the package sets for CPU runs (docs/cpu.md: the CPU step against PyTorch).

This module owns the XLA flags that sagm_jax adds for its CPU runs. XLA reads
``XLA_FLAGS`` once, when JAX starts its backend, so ``configure()`` must run
before the first JAX computation; later it changes nothing and says so.

The flags kept, measured on the 2-core development CPU (jax 0.10.2; figures in
docs/cpu.md, "The CPU step, against PyTorch's"):

  --xla_cpu_enable_concurrency_optimized_scheduler=false
      XLA's CPU default schedules the step's operations to run side by side,
      which keeps many activations alive at once. The memory-minimising schedule
      cuts the ResNet-50 SAGM step's temporary buffers (224x224, batch 24) from
      3.5 to 2.4 GB and the process's peak RSS from 5.4 to 4.1 GB, for about 2-3%
      of step time; the results are bit-identical (only the order of independent
      operations changes). It is a CPU-only option; other backends ignore it.

  --xla_cpu_experimental_ynn_fusion_type=dot,reduce
      Which operations XLA hands to YNNPACK. This jaxlib's default also hands it
      the convolutions, whose YNNPACK kernels are slower than XLA's own (Eigen)
      on every 3x3 and 7x7 convolution of the ResNets: summed over one ResNet-50
      pass at 224x224, batch 24, forward 370 vs 279 ms, input gradient 363 vs
      326 ms, kernel gradient 720 vs 350 ms. Turning YNNPACK off altogether is
      worse still, because XLA's own column reductions are slow: the frozen
      BatchNorm's scale and bias gradients (sums over batch and space) took
      150-190 ms each at ResNet-50's second stage, 40% of the step. So the dots
      (the 1x1 convolutions, the classifier) and the reductions go to YNNPACK,
      the other convolutions to XLA's own kernels: the ResNet-18 64x64 ERM step
      458 -> 315 ms, the ResNet-50 224x224 SAGM step 7.9 -> 6.8 s. Results change
      by float rounding only (other kernels, other summation orders).

Flags measured and not kept (see docs/cpu.md): ``--xla_cpu_use_onednn`` and
``--xla_cpu_experimental_onednn_custom_call`` (no effect: this jaxlib is built
without oneDNN), ``--xla_cpu_use_xnnpack=false`` (no gain), YNNPACK element-wise
fusions (``eltwise`` added to the list above: the 64x64 step 315 -> 397 ms),
``--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY`` (no
gain), ``--xla_cpu_use_thunk_runtime=false`` (deprecated, slower),
``--xla_cpu_multi_thread_eigen=false`` (slower).
"""

from __future__ import annotations

import os
import warnings

CPU_FLAGS = (
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "--xla_cpu_experimental_ynn_fusion_type=dot,reduce",
)


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
