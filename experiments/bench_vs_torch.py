"""Our jitted train step against the same step in plain PyTorch, on the same CPU, in one run.

    pip install -e '.[torch]'
    python experiments/bench_vs_torch.py [--rounds 5] [--rows 0 1 2 3] [--no-memory] [--check]

The PyTorch side is written here from the update rules (sagm-spec.md), not imported
from any other code: torchvision's ResNet-18/50 layout with DomainBed's head (frozen
BatchNorm, dropout 0.5 on the pooled feature, a fresh linear layer), float32, NCHW,
PyTorch's default CPU kernels (oneDNN), ``torch.set_num_threads(--threads)``, and

    ERM:  g = grad L(w);  Adam(lr, weight_decay=wd).step(g)
    SAGM: g = grad L(w);  e = (rho / (||g|| + 1e-12) - alpha) g;  g_p = grad L(w + e);
          Adam(lr, weight_decay=wd).step(0.5 (g + g_p)) at w

(||g|| the norm of the per-tensor norms, as the authors' code takes it). Ours is
``sagm_jax.train_step.make_train_step`` with ``paper_optimizer``, jitted with the
state donated, exactly as training runs it, with ``sagm_jax.cpu.configure()``'s
XLA flags.

Timing: both sides are built and warmed up, then every round runs one step of
ours and one of PyTorch's, alternating which goes first, so the drift of a shared
machine hits both alike; a row's figure is the median over rounds. Peak memory is
the peak RSS of a fresh process per side and row (import, build, compile, two
steps), so neither side's memory counts against the other. ``--check`` first runs
one SAGM step of both from the same weights (dropout off) and prints how far the
losses and the updated parameters differ.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import numpy as np

# (arch, image size, batch, algorithm): the rows of issue 12's table.
ROWS = (
    ("resnet18", 64, 96, "erm"),
    ("resnet18", 64, 96, "sagm"),
    ("resnet18", 96, 96, "erm"),
    ("resnet50", 224, 24, "sagm"),
)
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


def torch_step(model, algorithm: str):
    """One train step of ``algorithm`` on ``model``: ``step(x, y) -> clean loss``."""
    import torch
    from torch.nn import functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def loss_and_grads(x, y):
        loss = F.cross_entropy(model(x), y)
        return loss, torch.autograd.grad(loss, params)

    def step(x, y):
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


def torch_setup(arch, size, batch, algorithm, threads, dropout=DROPOUT, state_dict=None):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch_resnet(arch, NUM_CLASSES, dropout)
    if state_dict is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict.items()})
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(batch, 3, size, size)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, NUM_CLASSES, batch))
    step = torch_step(model, algorithm)
    return lambda: float(step(x, y)), model


# ----------------------------------------------------------------------------- our side


def ours_setup(arch, size, batch, algorithm, dropout=DROPOUT, variables=None):
    import jax
    import jax.numpy as jnp

    import sagm_jax
    from sagm_jax import models
    from sagm_jax.train_step import create_train_state, make_train_step

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
    step = jax.jit(make_train_step(model, opt, algorithm=algorithm), donate_argnums=0)
    holder = {"state": create_train_state(variables, opt)}
    key = jax.random.key(1)

    def run():
        holder["state"], metrics = step(holder["state"], batch_, key)
        return float(metrics["loss"])  # waits for the step

    return run, holder


# ----------------------------------------------------------------------------- measurements


def peak_rss_child(side, row, threads):
    """Peak RSS (MiB) of a fresh process that builds ``side``'s step of ``row``, runs two steps."""
    code = (
        "import bench_vs_torch as b\n"
        f"if {side!r} == 'ours': import sagm_jax.cpu; sagm_jax.cpu.configure()\n"
        f"row = b.ROWS[{row}]\n"
        f"run = (b.ours_setup(*row) if {side!r} == 'ours' else b.torch_setup(*row, {threads}))[0]\n"
        "run(); run()\n"
        # VmHWM, not ru_maxrss: Linux carries the parent's peak into ru_maxrss across fork+exec.
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(int(hwm.split()[1]) / 1024)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))  # `python -c` imports from its cwd
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=here
    )
    return float(out.stdout.strip().splitlines()[-1])


def check_agreement(threads):
    """One SAGM step of both from the same weights (dropout off): loss and parameter differences."""
    import jax

    from sagm_jax import models
    from sagm_jax.models.synthetic import draw_torchvision_weights

    weights = draw_torchvision_weights("resnet18", 0, NUM_CLASSES)
    args = ("resnet18", 64, 8, "sagm")
    ours, holder = ours_setup(*args, dropout=0.0, variables=models.convert_torchvision(weights))
    theirs, model = torch_setup(*args, threads, dropout=0.0, state_dict=weights)
    with jax.default_matmul_precision("float32"):
        loss_ours = ours()
    loss_theirs = theirs()
    converted = models.convert_torchvision(
        {k: v.detach().numpy() for k, v in model.state_dict().items()}
    )["params"]
    start = jax.tree.leaves(models.convert_torchvision(weights)["params"])
    ours_params = jax.tree.leaves(holder["state"].params)
    ours_update = [np.asarray(a) - w0 for a, w0 in zip(ours_params, start)]
    theirs_update = [np.asarray(b) - w0 for b, w0 in zip(jax.tree.leaves(converted), start)]
    difference = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(ours_update, theirs_update)))
    worst = difference / np.sqrt(sum(np.sum(b**2) for b in theirs_update))
    print(
        f"check (resnet18 64x64, batch 8, SAGM, dropout off, same weights): loss ours "
        f"{loss_ours:.6f} vs PyTorch {loss_theirs:.6f}; ||update difference|| / "
        f"||update|| {worst:.1e}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="*", default=list(range(len(ROWS))))
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    import sagm_jax.cpu

    sagm_jax.cpu.configure()  # before JAX starts its backend
    import jax
    import torch

    print(
        f"{platform.processor() or platform.machine()}, jax {jax.__version__} "
        f"({jax.devices()[0].platform}), torch {torch.__version__} ({args.threads} threads, "
        f"oneDNN {torch.backends.mkldnn.is_available()}); float32; median of {args.rounds} "
        f"interleaved rounds"
    )
    if args.check:
        check_agreement(args.threads)
    print("| model, input, batch | algorithm | PyTorch ms/step | sagm-jax ms/step "
          "| PyTorch / ours | peak RSS MiB PyTorch / ours |")
    print("|---|---|---|---|---|---|")
    for row in args.rows:
        arch, size, batch, algorithm = ROWS[row]
        ours, _ = ours_setup(arch, size, batch, algorithm)
        theirs, _ = torch_setup(arch, size, batch, algorithm, args.threads)
        ours(), theirs()  # compile / warm up
        times = {"ours": [], "torch": []}
        for round_ in range(args.rounds):
            order = (("ours", ours), ("torch", theirs))
            for side, run in order if round_ % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                run()
                times[side].append(time.perf_counter() - start)
        t_ours, t_torch = (1e3 * float(np.median(times[s])) for s in ("ours", "torch"))
        memory = "n/a"
        if args.memory:
            memory = " / ".join(
                f"{peak_rss_child(side, row, args.threads):.0f}" for side in ("torch", "ours")
            )
        name = f"{'ResNet-18' if arch == 'resnet18' else 'ResNet-50'}, {size}x{size}, {batch}"
        print(
            f"| {name} | {algorithm.upper()} | {t_torch:,.0f} | {t_ours:,.0f} "
            f"| {t_torch / t_ours:.2f} | {memory} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
