"""Our jitted train step against the same step in plain PyTorch, on the same device, in one run.

    pip install -e '.[torch]'
    python experiments/bench_vs_torch.py [--device cpu|cuda] [--precisions fp32 bf16]
        [--rounds 5] [--steps 1] [--rows 0 1 2 3] [--row ARCH SIZE BATCH ALGORITHM]
        [--no-memory] [--check] [--only torch|ours]

The PyTorch side is written here from the update rules (docs/optimizers.md), not imported
from any other code: torchvision's ResNet-18/50 layout with DomainBed's head (frozen
BatchNorm, dropout 0.5 on the pooled feature, a fresh linear layer) and

    ERM:  g = grad L(w);  Adam(lr, weight_decay=wd).step(g)
    SAGM: g = grad L(w);  e = (rho / (||g|| + 1e-12) - alpha) g;  g_p = grad L(w + e);
          Adam(lr, weight_decay=wd).step(0.5 (g + g_p)) at w

(||g|| the norm of the per-tensor norms, as the authors' code takes it). Ours is
``sagm_jax.training.train_step.make_train_step`` with ``paper_optimizer``, jitted with the
state donated, exactly as training runs it.

``--device`` picks PyTorch's device (default: ``cuda`` when torch sees one, else
``cpu``); JAX runs on its default backend (``JAX_PLATFORMS=cpu`` forces the CPU),
and the header line says which. Precision pairs (``--precisions``), each row timed
for each pair, PyTorch against ours:

- ``fp32``: PyTorch float32 as the authors run it (NCHW, PyTorch's default math:
  on CUDA ``torch.backends.cudnn.allow_tf32=True`` (TF32 convolutions) and
  ``torch.backends.cuda.matmul.allow_tf32=False``), against ours in float32 (JAX's
  default precision: TF32 convolutions and matrix products on a GPU).
- ``bf16``: the strongest eager PyTorch a user would write: ``torch.autocast(device,
  dtype=torch.bfloat16)`` around the forward pass and the loss, the model and the
  batch in ``channels_last``, and on CUDA TF32 allowed for what stays float32 (both
  flags on); against ours with ``compute_dtype=bfloat16`` (parameters and images cast
  for the forward and backward passes; parameters, optimizer and loss in float32, as
  autocast keeps them).

Each PyTorch step sets its pair's TF32 flags when it starts, so the pairs never
see each other's. On CUDA ``torch.backends.cudnn.benchmark`` is on (``--no-cudnn_benchmark``
for PyTorch's default; DomainBed's own train.py turns it off for determinism),
``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.45 so the two frameworks share the
GPU, and JAX keeps XLA's GPU defaults. On the CPU, ``torch.set_num_threads(--threads)``
and PyTorch's default kernels (oneDNN) against ours with ``sagm_jax.cpu.configure()``'s
XLA flags (set only when ``--device cpu``).

Presets: ``--device cpu`` times docs/cpu.md's rows (``ROWS``, ``--rows`` picks some),
``--device cuda`` the paper's setting (``GPU_ROWS``: ResNet-50, 224x224, batch 96 =
32 x 3 training domains, SAGM); ``--row`` adds any (repeatable).

Timing: both sides are built and warmed up, then every round runs ``--steps`` steps
of ours and ``--steps`` of PyTorch's, alternating which goes first, so the drift of
a shared machine hits both alike; a side's round ends when its device is idle
(``jax.block_until_ready`` on the state, ``torch.cuda.synchronize()`` on CUDA); a
row's figure is the median over rounds of round time / steps. Peak memory: on the
CPU, the peak RSS of a fresh process per side, row and pair (import, build, compile,
two steps), so neither side's memory counts against the other; on CUDA, PyTorch's
``torch.cuda.max_memory_allocated`` over its build and timing against XLA's buffer
plan of our compiled step (arguments + outputs + temporaries). ``--check`` first runs
one SAGM step of both from the same weights (dropout off, full float32: TF32 off on
both sides) and prints how far the losses and the updated parameters differ.
``--only torch`` or ``--only ours`` times one side alone (no ratio), for a machine where
the two frameworks cannot share one process or one GPU.

The whole input loop (DataLoader with DomainBed's transforms against our store,
prefetch and device augmentation) is raced by ``experiments/race_loop.py``.

On the GPU machine of this workplace torch, torchvision, JAX (CUDA), flax, optax,
orbax and Pillow are installed; ml-collections (which ``sagm_jax`` imports) must be
carried as a wheel (see experiments/race_loop.py's docstring for the command).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import numpy as np

# (arch, image size, batch, algorithm): the rows of docs/cpu.md's table (the CPU preset).
ROWS = (
    ("resnet18", 64, 96, "erm"),
    ("resnet18", 64, 96, "sagm"),
    ("resnet18", 96, 96, "erm"),
    ("resnet50", 224, 24, "sagm"),
)
# The paper's setting: ResNet-50 at 224x224, 32 images from each of 3 training domains.
GPU_ROWS = (("resnet50", 224, 96, "sagm"),)
# Precision pairs: (what PyTorch runs, what ours runs).
PRECISIONS = {
    "fp32": ("float32", "float32"),
    "bf16": ("bf16 autocast + channels_last", "bfloat16"),
}
NUM_CLASSES = 7
DROPOUT = 0.5
LR, WEIGHT_DECAY, RHO, ALPHA = 5e-5, 1e-4, 0.05, 1e-3


# ----------------------------------------------------------------------------- PyTorch side


def torch_resnet(arch: str, num_classes: int, dropout: float):
    """torchvision's ResNet (state-dict names included) with DomainBed's frozen-BN head."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class FrozenBatchNorm(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(channels))
            self.bias = nn.Parameter(torch.zeros(channels))
            self.register_buffer("running_mean", torch.zeros(channels))
            self.register_buffer("running_var", torch.ones(channels))

        def forward(self, x):
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, 1e-5
            )

    def conv(cin, cout, k, stride):
        return nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)

    class Block(nn.Module):
        def __init__(self, bottleneck, cin, width, stride):
            super().__init__()
            cout = width * (4 if bottleneck else 1)
            self.bottleneck = bottleneck
            if bottleneck:
                self.conv1, self.bn1 = conv(cin, width, 1, 1), FrozenBatchNorm(width)
                self.conv2, self.bn2 = conv(width, width, 3, stride), FrozenBatchNorm(width)
                self.conv3, self.bn3 = conv(width, cout, 1, 1), FrozenBatchNorm(cout)
            else:
                self.conv1, self.bn1 = conv(cin, width, 3, stride), FrozenBatchNorm(width)
                self.conv2, self.bn2 = conv(width, width, 3, 1), FrozenBatchNorm(width)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(conv(cin, cout, 1, stride), FrozenBatchNorm(cout))

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            if self.bottleneck:
                y = F.relu(self.bn2(self.conv2(y)))
                y = self.bn3(self.conv3(y))
            else:
                y = self.bn2(self.conv2(y))
            shortcut = x if self.downsample is None else self.downsample(x)
            return F.relu(y + shortcut)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            bottleneck, sizes = {
                "resnet18": (False, (2, 2, 2, 2)),
                "resnet50": (True, (3, 4, 6, 3)),
            }[arch]
            self.conv1, self.bn1 = conv(3, 64, 7, 2), FrozenBatchNorm(64)
            cin = 64
            for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), sizes), start=1):
                layer = []
                for index in range(blocks):
                    stride = 2 if stage > 1 and index == 0 else 1
                    layer.append(Block(bottleneck, cin, width, stride))
                    cin = width * (4 if bottleneck else 1)
                setattr(self, f"layer{stage}", nn.Sequential(*layer))
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            features = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
            return self.fc(F.dropout(features, dropout, training=dropout > 0))

    return ResNet()


def torch_flags(device: str, precision: str):
    """(cudnn.allow_tf32, cuda.matmul.allow_tf32) of a precision on ``device`` (None: CPU).

    "fp32" is PyTorch's default math, "bf16" allows TF32 wherever autocast leaves
    float32, "exact" (``--check`` only) is full float32.
    """
    if device != "cuda":
        return None
    return {"fp32": (True, False), "bf16": (True, True), "exact": (False, False)}[precision]


def torch_step(model, algorithm: str, device: str = "cpu", precision: str = "fp32"):
    """One train step of ``algorithm`` on ``model``: ``step(x, y) -> clean loss``.

    ``precision`` "bf16" runs the forward pass and the loss under
    ``torch.autocast(device, torch.bfloat16)`` (the parameters, their gradients and
    Adam stay float32); "fp32" is plain float32.
    """
    import contextlib

    import torch
    from torch.nn import functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    flags = torch_flags(device, precision)

    def autocast():
        if precision == "bf16":
            return torch.autocast(device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss_and_grads(x, y):
        with autocast():
            loss = F.cross_entropy(model(x), y)
        return loss, torch.autograd.grad(loss, params)

    def step(x, y):
        if flags is not None:  # this pair's math, whatever the other pair set
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags
        loss, grads = loss_and_grads(x, y)
        if algorithm == "sagm":
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            scale = RHO / (norm + 1e-12) - ALPHA
            perturbation = torch._foreach_mul(grads, scale)
            with torch.no_grad():
                torch._foreach_add_(params, perturbation)
            _, perturbed = loss_and_grads(x, y)
            with torch.no_grad():
                torch._foreach_sub_(params, perturbation)
            grads = torch._foreach_mul(torch._foreach_add(grads, perturbed), 0.5)
        elif algorithm != "erm":
            raise ValueError(algorithm)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        return loss.detach()

    return step


def torch_setup(
    arch, size, batch, algorithm, threads, dropout=DROPOUT, state_dict=None,
    device="cpu", precision="fp32",
):
    """``(run, model)``: ``run(steps)`` runs ``steps`` steps on one constant batch, waits
    for the device and returns the last clean loss."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch_resnet(arch, NUM_CLASSES, dropout)
    if state_dict is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()})
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(batch, 3, size, size)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, NUM_CLASSES, batch))
    model, x, y = model.to(device), x.to(device), y.to(device)
    if precision == "bf16":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    step = torch_step(model, algorithm, device, precision)

    def run(steps=1):
        for _ in range(steps):
            loss = step(x, y)
        if device == "cuda":
            torch.cuda.synchronize()
        return float(loss)

    return run, model


# ----------------------------------------------------------------------------- our side


def ours_setup(
    arch, size, batch, algorithm, dropout=DROPOUT, variables=None, compute_dtype="float32"
):
    """``(run, holder)``: ``run(steps)`` runs ``steps`` steps on one constant batch, waits for
    the state and returns the last clean loss; ``holder["state"]`` is the train state,
    ``holder["plan_bytes"]`` XLA's buffer plan of the compiled step (None if unknown)."""
    import jax
    import jax.numpy as jnp

    import sagm_jax
    from sagm_jax import models
    from sagm_jax.training.train_step import create_train_state, make_train_step

    model = models.create(arch, NUM_CLASSES, dropout_rate=dropout)
    rng = np.random.default_rng(0)
    batch_ = {
        "image": jnp.asarray(
            rng.normal(size=(batch, 3, size, size)).transpose(0, 2, 3, 1), jnp.float32
        ),
        "label": jnp.asarray(rng.integers(0, NUM_CLASSES, batch), jnp.int32),
    }
    if variables is None:  # one image is enough to shape the parameters
        init = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))
        variables = init(batch_["image"][:1])
    opt = sagm_jax.paper_optimizer(
        algorithm, learning_rate=LR, weight_decay=WEIGHT_DECAY, rho=RHO, alpha=ALPHA
    )
    step = jax.jit(
        make_train_step(model, opt, algorithm=algorithm, compute_dtype=jnp.dtype(compute_dtype)),
        donate_argnums=0,
    )
    key = jax.random.key(1)
    holder = {"state": create_train_state(variables, opt)}
    compiled = step.lower(holder["state"], batch_, key).compile()
    memory = compiled.memory_analysis()
    holder["plan_bytes"] = None if memory is None else (
        memory.argument_size_in_bytes + memory.output_size_in_bytes
        + memory.temp_size_in_bytes - memory.alias_size_in_bytes
    )

    def run(steps=1):
        for _ in range(steps):
            holder["state"], metrics = compiled(holder["state"], batch_, key)
        jax.block_until_ready(holder["state"])
        return float(metrics["loss"])

    return run, holder


# ----------------------------------------------------------------------------- measurements


def peak_rss_child(side, row, precision, threads):
    """Peak RSS (MiB) of a fresh process that builds ``side``'s step of ``row``, runs two steps."""
    ours_dtype = PRECISIONS[precision][1]
    code = (
        "import bench_vs_torch as b\n"
        f"if {side!r} == 'ours': import sagm_jax.cpu; sagm_jax.cpu.configure()\n"
        f"row = {tuple(row)!r}\n"
        f"run = (b.ours_setup(*row, compute_dtype={ours_dtype!r}) if {side!r} == 'ours' "
        f"else b.torch_setup(*row, {threads}, precision={precision!r}))[0]\n"
        "run(); run()\n"
        # VmHWM, not ru_maxrss: Linux carries the parent's peak into ru_maxrss across fork+exec.
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(int(hwm.split()[1]) / 1024)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))  # `python -c` imports from its cwd
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=here,
        env=env,
    )
    return float(out.stdout.strip().splitlines()[-1])


def check_agreement(threads, device="cpu"):
    """One SAGM step of both from the same weights (dropout off): loss and parameter differences."""
    import jax

    from sagm_jax import models
    from sagm_jax.models.synthetic import draw_torchvision_weights

    weights = draw_torchvision_weights("resnet18", 0, NUM_CLASSES)
    args = ("resnet18", 64, 8, "sagm")
    with jax.default_matmul_precision("float32"):  # traced and compiled without TF32
        ours, holder = ours_setup(
            *args, dropout=0.0, variables=models.convert_torchvision(weights)
        )
        loss_ours = ours()
    theirs, model = torch_setup(
        *args, threads, dropout=0.0, state_dict=weights, device=device, precision="exact"
    )
    loss_theirs = theirs()
    converted = models.convert_torchvision(
        {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    )["params"]
    start = jax.tree.leaves(models.convert_torchvision(weights)["params"])
    ours_params = jax.tree.leaves(holder["state"].params)
    ours_update = [np.asarray(a) - w0 for a, w0 in zip(ours_params, start)]
    theirs_update = [np.asarray(b) - w0 for b, w0 in zip(jax.tree.leaves(converted), start)]
    difference = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(ours_update, theirs_update)))
    worst = difference / np.sqrt(sum(np.sum(b**2) for b in theirs_update))
    print(
        f"check (resnet18 64x64, batch 8, SAGM, dropout off, same weights, float32 without "
        f"TF32, {device}): loss ours {loss_ours:.6f} vs PyTorch {loss_theirs:.6f}; "
        f"||update difference|| / ||update|| {worst:.1e}"
    )


def header(args, jax, torch) -> str:
    backend = jax.devices()[0]
    if args.device == "cuda":
        torch_side = (
            f"torch {torch.__version__} on {torch.cuda.get_device_name()} (CUDA "
            f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, cudnn.benchmark "
            f"{torch.backends.cudnn.benchmark}; TF32: fp32 pair convolutions on, matmul off "
            f"(PyTorch's defaults), bf16 pair both on)"
        )
        jax_side = (
            f"jax {jax.__version__} on {backend.platform}: {backend.device_kind} (XLA's GPU "
            f"defaults: TF32 in float32; XLA_PYTHON_CLIENT_MEM_FRACTION="
            f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'default')})"
        )
    else:
        torch_side = (
            f"torch {torch.__version__} on the CPU ({args.threads} threads, oneDNN "
            f"{torch.backends.mkldnn.is_available()})"
        )
        jax_side = f"jax {jax.__version__} on {backend.platform} (sagm_jax.cpu.configure())"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {torch_side}; "
        f"{jax_side}; median of {args.rounds} interleaved rounds of {args.steps} step(s) a side"
    )


def main():
    import torch

    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device,
                        help=f"PyTorch's device (default here: {default_device})")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=None,
                        help="precision pairs (default: fp32 on cpu, fp32 bf16 on cuda)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per side per round (default: 1 on cpu, 10 on cuda)")
    parser.add_argument("--rows", type=int, nargs="*", default=None,
                        help="indices into the device's preset (ROWS on cpu, GPU_ROWS on cuda)")
    parser.add_argument("--row", nargs=4, action="append", default=[],
                        metavar=("ARCH", "SIZE", "BATCH", "ALGORITHM"), help="an extra row")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--no-cudnn_benchmark", dest="cudnn_benchmark", action="store_false")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--only", choices=("torch", "ours"), default=None,
                        help="time one side alone (if the two frameworks cannot share a process)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    args.precisions = args.precisions or (["fp32", "bf16"] if cuda else ["fp32"])
    args.steps = args.steps or (10 if cuda else 1)
    preset = GPU_ROWS if cuda else ROWS
    rows = [preset[i] for i in (range(len(preset)) if args.rows is None else args.rows)]
    rows += [(arch, int(size), int(batch), algorithm) for arch, size, batch, algorithm in args.row]

    if cuda:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    else:
        import sagm_jax.cpu

        sagm_jax.cpu.configure()  # before JAX starts its backend
    import jax

    print(header(args, jax, torch))
    platform_ = jax.devices()[0].platform
    if (platform_ == "cpu") != (not cuda):
        print(f"note: PyTorch runs on {args.device}, JAX on {platform_}")
    if args.check and args.only is None:
        check_agreement(args.threads, args.device)
    memory_kind = ("torch.cuda.max_memory_allocated / XLA buffer plan" if cuda
                   else "peak RSS, fresh process each")
    print(f"| model, input, batch | algorithm | PyTorch / ours | PyTorch ms/step "
          f"| ours ms/step | PyTorch img/s | ours img/s | ours / PyTorch "
          f"| MiB PyTorch / ours ({memory_kind}) |")
    print("|---|---|---|---|---|---|---|---|---|")
    sides = ("ours", "torch") if args.only is None else (args.only,)
    for row in rows:
        arch, size, batch, algorithm = row
        for precision in args.precisions:
            theirs_name, ours_dtype = PRECISIONS[precision]
            runs, holder = {}, {}
            if "ours" in sides:
                runs["ours"], holder = ours_setup(
                    arch, size, batch, algorithm, compute_dtype=ours_dtype
                )
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if "torch" in sides:
                runs["torch"], _ = torch_setup(
                    arch, size, batch, algorithm, args.threads, device=args.device,
                    precision=precision,
                )
            for run in runs.values():  # compile / warm up (cuDNN's autotuning too)
                run()
                run(args.steps)
            times = {side: [] for side in runs}
            for round_ in range(args.rounds):
                order = list(runs.items())
                for side, run in order if round_ % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    run(args.steps)
                    times[side].append((time.perf_counter() - start) / args.steps)
            t = {side: float(np.median(times[side])) for side in runs}
            memory = {"ours": "n/a", "torch": "n/a"}
            if args.memory and cuda:
                if "torch" in runs:
                    memory["torch"] = f"{torch.cuda.max_memory_allocated() / 2**20:,.0f}"
                if holder.get("plan_bytes") is not None:
                    memory["ours"] = f"{holder['plan_bytes'] / 2**20:,.0f}"
            elif args.memory:
                for side in runs:
                    memory[side] = f"{peak_rss_child(side, row, precision, args.threads):,.0f}"

            ms = {side: f"{1e3 * t[side]:,.1f}" if side in t else "n/a" for side in memory}
            rate = {side: f"{batch / t[side]:,.0f}" if side in t else "n/a" for side in memory}
            ratio = f"{t['torch'] / t['ours']:.2f}" if len(t) == 2 else "n/a"
            name = f"{'ResNet-18' if arch == 'resnet18' else 'ResNet-50'}, {size}x{size}, {batch}"
            print(
                f"| {name} | {algorithm.upper()} | {theirs_name} / {ours_dtype} "
                f"| {ms['torch']} | {ms['ours']} | {rate['torch']} | {rate['ours']} "
                f"| {ratio} | {memory['torch']} / {memory['ours']} |",
                flush=True,
            )
            del runs, holder
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
