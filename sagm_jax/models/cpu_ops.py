"""ResNet operations in the forms that XLA's CPU backend runs fast (docs/cpu.md).

This module owns the CPU-only reformulations of the ResNet's operations. Each one
computes what the plain ``jax.lax`` operation computes (the same numbers up to float
rounding, or exactly), is used by ``resnet.py`` only when JAX runs on the CPU, and
is tested against an independent NumPy computation. Accelerators keep XLA's own
operations.

Convolutions (``conv_as_patches``). XLA's CPU backend swaps the operands of a
convolution whose kernel is larger than its input or output (a 3x3 kernel on the
2x2 maps of ResNet's last stage at 64x64 images, and the backward pass of the
stride-2 convolution before it) and runs the swapped one as a naive loop, 20-100
times slower than the same arithmetic as one dot. 1x1 convolutions are a dot
already (strided: a strided slice first).

Max-pooling (``max_pool``). JAX differentiates ``lax.reduce_window(max)`` through
``select_and_gather_add``, which XLA's CPU backend runs as a reduce-window over
(value, position) pairs fed by four iota arrays of the padded input's size: in a
ResNet-18 step at 96x96 it was a tenth of the step. Here the forward pass is the
maximum of the k*k strided windows (exact), and the backward pass sends each
output's gradient to the first maximal position of its window in row-major order,
torch's ``max_pool2d`` rule and XLA's: ``first[o] = min{t : window_t[o] = y[o]}``
(one int8 per output, the only residual), ``dx = sum_t place_t(dy * [first = t])``
where ``place_t`` puts an output-grid array at tap t's input positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def uses_patches(kernel: int, input_size: int, output_size: int) -> bool:
    """Whether a convolution runs as ``conv_as_patches`` instead of XLA's, on the CPU.

    Kernels larger than the input or output map (XLA's naive loop), and 1x1 kernels.
    """
    return kernel == 1 or kernel > min(input_size, output_size)


def _output_size(size: int, window: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - window) // stride + 1


def _taps(padded: jax.Array, window: int, stride: int, out_h: int, out_w: int) -> list:
    """The window*window strided views of ``padded`` (NHWC) that line up with the output."""
    return [
        padded[:, i : i + stride * (out_h - 1) + 1 : stride, j : j + stride * (out_w - 1) + 1 : stride]
        for i in range(window)
        for j in range(window)
    ]


def conv_as_patches(x: jax.Array, w: jax.Array, stride: int, pad: int) -> jax.Array:
    """The convolution of NHWC ``x`` with HWIO ``w`` as a dot of its k*k shifted windows."""
    k, channels = w.shape[0], x.shape[-1]
    out_h, out_w = (_output_size(s, k, stride, pad) for s in x.shape[1:3])
    if pad:
        x = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    windows = _taps(x, k, stride, out_h, out_w)
    patches = windows[0] if k == 1 else jnp.concatenate(windows, axis=-1)
    return jnp.einsum("bhwk,ko->bhwo", patches, w.reshape(k * k * channels, -1))


def _pool_taps(x, window, stride, pad):
    out_h, out_w = (_output_size(s, window, stride, pad) for s in x.shape[1:3])
    padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=-jnp.inf)
    return _taps(padded, window, stride, out_h, out_w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def max_pool(x: jax.Array, window: int, stride: int, pad: int) -> jax.Array:
    """``nn.max_pool(x, (window,) * 2, (stride,) * 2, ((pad, pad),) * 2)`` of NHWC ``x``."""
    return functools.reduce(jnp.maximum, _pool_taps(x, window, stride, pad))


def _max_pool_forward(x, window, stride, pad):
    taps = _pool_taps(x, window, stride, pad)
    y = functools.reduce(jnp.maximum, taps)
    first = jnp.full(y.shape, len(taps) - 1, jnp.int8)
    for t in reversed(range(len(taps) - 1)):
        first = jnp.where(taps[t] == y, jnp.int8(t), first)
    return y, (first, x.shape)


def _max_pool_backward(window, stride, pad, residuals, dy):
    first, (_, height, width, _) = residuals
    out_h, out_w = dy.shape[1:3]
    zero = jnp.zeros((), dy.dtype)
    dx = zero
    for t in range(window * window):
        i, j = divmod(t, window)
        config = [
            (0, 0, 0),
            (i, height + 2 * pad - i - stride * (out_h - 1) - 1, stride - 1),
            (j, width + 2 * pad - j - stride * (out_w - 1) - 1, stride - 1),
            (0, 0, 0),
        ]
        dx = dx + jax.lax.pad(jnp.where(first == t, dy, zero), zero, config)
    return (dx[:, pad : pad + height, pad : pad + width],)


max_pool.defvjp(_max_pool_forward, _max_pool_backward)
