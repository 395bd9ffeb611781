"""The whole training loop against the authors' PyTorch loop, on one synthetic PACS-like folder.

    pip install -e '.[torch]' torchvision
    python experiments/race_loop.py [--device cpu|cuda] [--precisions fp32 bf16]
        [--arch resnet50] [--image_size 224] [--batch_per_env 32] [--workers 16]
        [--steps 200] [--warmup 20] [--rounds 4] [--images_per_class 40]
        [--torch_loss_every 1] [--only torch|ours]

One folder (``bench_input.write_tree``: 4 domains x 7 classes of 227x227 JPEGs),
domain 3 held out, domains 0-2 trained on (their DomainBed "in" splits, 80%), is
trained for ``--steps`` SAGM steps by

- PyTorch, as DomainBed and the authors run it: torchvision ``ImageFolder`` per
  domain with DomainBed's training transforms (``RandomResizedCrop(image_size,
  scale=(0.7, 1.0))``, ``RandomHorizontalFlip``, ``ColorJitter(0.3, 0.3, 0.3, 0.3)``,
  ``RandomGrayscale(p=0.1)``, ``ToTensor``, ``Normalize`` with ImageNet's mean and
  std), one ``DataLoader`` per training domain with ``--workers`` workers each, fed
  by DomainBed's infinite sampler (``RandomSampler`` with replacement, batches of
  ``--batch_per_env``, ``drop_last``), ``pin_memory`` on CUDA; each step moves the
  three minibatches to the device, concatenates them and runs the SAGM step of
  ``bench_vs_torch.torch_step`` (fp32: float32 as the authors run it; bf16:
  ``torch.autocast`` bfloat16 + ``channels_last``, TF32 allowed), and reads the loss
  every ``--torch_loss_every`` steps (1, the default: DomainBed's ``update`` returns
  ``loss.item()`` each step; 10 reads it as our loop does);
- ours, as ``sagm_jax.main`` runs it: ``train.setup`` on ``configs/pacs.py`` with
  ``dataset="ImageFolder"``, ``pretrained_weights="none"`` (the decoded store, built
  once and reported separately), ``train_iterator`` -> ``prefetch_to_mesh`` -> the
  jitted data-parallel SAGM step with its device augmentation, in float32 or
  ``compute_dtype=bfloat16``, the loss read every 10 steps as the run loop does.

Both sides start from random weights (speed does not depend on them) with the same
model (ResNet-50 or -18 with DomainBed's head). For each precision pair both loops
are built and warmed up (``--warmup`` steps: compilation, cuDNN's autotuning, the
DataLoader workers' start), then ``--rounds`` rounds each run ``--steps / --rounds``
steps of one side and then of the other, alternating which goes first; a side's
chunk ends when its device is idle. Printed: steps/s and images/s of each side and
ours / PyTorch. The one-time costs are printed apart: writing the folder, our store
build (``train.setup``), and each side's warm-up.

The DataLoaders are started once, before JAX starts (their workers are forked from a
process without JAX's threads), and feed both pairs. Their workers keep ``prefetch_factor``
(2) batches each ready, so after a PyTorch chunk they decode up to that many batches
while our chunk runs: on a machine with cores to spare (16 on the GPU machine) this
costs ours little; on a small CPU it counts against ours. On CUDA
``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.45 (the two frameworks share the GPU)
and ``torch.backends.cudnn.benchmark`` is on (``--no-cudnn_benchmark``: off).

No TensorFlow on any of these paths. On this workplace's GPU machine torch,
torchvision, JAX (CUDA), flax, optax, orbax, Pillow, absl and PyYAML are installed,
but not ml-collections (which ``sagm_jax``'s config needs): carry its pure-Python
wheel. Once, in the repository root of the machine that calls the device:

    mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl ml_collections==1.1.0 simplejpeg==1.9.0

(simplejpeg only in case the data path imports it: sagm_jax's compressed store uses it)

then run with ``.whl`` carried and the command starting
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
export PYTHONPATH=$PWD:/tmp/site``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import tempfile
import time

import numpy as np

import bench_input  # experiments/, the script's own folder
import bench_vs_torch
import device_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_ENVS = (0, 1, 2)
TEST_ENVS = (3,)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
OUR_LOSS_EVERY = 10  # sagm_jax's run loop reads the loss every log_every=10 steps
PRECISIONS = {  # pair: (PyTorch's, ours)
    "fp32": ("float32", "float32"),
    "bf16": ("bf16 autocast + channels_last", "bfloat16"),
}


# ----------------------------------------------------------------------------- PyTorch side


def domainbed_in_split(n: int, env: int, trial_seed: int = 0) -> list[int]:
    """DomainBed's "in" split of environment ``env`` (docs/protocol.md, "Splits")."""
    seed = int(hashlib.md5(str((trial_seed, env)).encode("utf-8")).hexdigest(), 16) % 2**31
    keys = list(range(n))
    np.random.RandomState(seed).shuffle(keys)
    return keys[int(n * 0.2):]


def torch_batches(folder, args, pin_memory):
    """DomainBed's training input: an iterator of per-domain ``(x, y)`` minibatch tuples."""
    import torch
    from torchvision import datasets, transforms

    class InfiniteSampler(torch.utils.data.Sampler):
        """Yields the batches of ``batch_sampler`` again and again (DomainBed's)."""

        def __init__(self, batch_sampler):
            self.batch_sampler = batch_sampler

        def __iter__(self):
            while True:
                yield from self.batch_sampler

    transform = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size, scale=(0.7, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.3, 0.3, 0.3, 0.3),
        transforms.RandomGrayscale(),  # p=0.1
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    domains = sorted(os.listdir(folder))
    loaders = []
    for env in TRAIN_ENVS:
        dataset = datasets.ImageFolder(os.path.join(folder, domains[env]), transform)
        dataset = torch.utils.data.Subset(dataset, domainbed_in_split(len(dataset), env))
        sampler = torch.utils.data.RandomSampler(dataset, replacement=True)
        batch_sampler = torch.utils.data.BatchSampler(sampler, args.batch_per_env, drop_last=True)
        loaders.append(
            torch.utils.data.DataLoader(
                dataset,
                num_workers=args.workers,
                batch_sampler=InfiniteSampler(batch_sampler),
                pin_memory=pin_memory,
            )
        )
    return zip(*[iter(loader) for loader in loaders])


def torch_loop(batches, args, precision):
    """``run(n)``: trains ``n`` steps from ``batches`` and waits for the device."""
    import torch

    device = args.device
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = bench_vs_torch.torch_resnet(args.arch, 7, bench_vs_torch.DROPOUT).to(device)
    if precision == "bf16":
        model = model.to(memory_format=torch.channels_last)
    step = bench_vs_torch.torch_step(model, "sagm", device, precision)
    non_blocking = device == "cuda"

    def run(n):
        for t in range(n):
            minibatches = [
                (x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking))
                for x, y in next(batches)
            ]
            x = torch.cat([x for x, _ in minibatches])
            y = torch.cat([y for _, y in minibatches])
            if precision == "bf16":
                x = x.contiguous(memory_format=torch.channels_last)
            loss = step(x, y)
            if t % args.torch_loss_every == 0:
                float(loss)
        if device == "cuda":
            torch.cuda.synchronize()

    return run


# ----------------------------------------------------------------------------- our side


def our_loop(folder, cache_dir, args, compute_dtype):
    """``(run, close, setup_seconds)``: our real loop, as device_report's ``loop`` section."""
    import jax

    from sagm_jax.training import train
    from sagm_jax.data.pipeline import prefetch_to_mesh

    config = device_report.pacs_like_config(  # held out: domain 3, as TEST_ENVS
        folder, cache_dir, args, batch_per_env=args.batch_per_env, compute_dtype=compute_dtype
    )
    start = time.perf_counter()
    program = train.setup(config)  # opens the data (builds the store), model, steps
    setup_seconds = time.perf_counter() - start
    train_step, state = program.train_step, program.state
    batches = prefetch_to_mesh(
        program.dataset.train_iterator(
            list(TRAIN_ENVS), seed=0, batch_per_env=config.batch_per_env
        ),
        program.mesh,
    )
    key = jax.random.key(1)

    def run(n):
        nonlocal state
        for t in range(n):
            state, metrics = train_step(state, next(batches), key)
            if t % OUR_LOSS_EVERY == 0:
                float(metrics["loss"])
        jax.block_until_ready(state)

    def close():
        batches.close()  # stops and joins the prefetch thread

    return run, close, setup_seconds


# ----------------------------------------------------------------------------- the race


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def race(folder, cache_dir, batches, args, precision, report):
    theirs_name, ours_dtype = PRECISIONS[precision]
    runs, closers, setup = {}, [], "n/a"
    if args.only in (None, "ours"):
        runs["ours"], close, setup_seconds = our_loop(folder, cache_dir, args, ours_dtype)
        closers.append(close)
        setup = f"{setup_seconds:.1f}"
    if args.only in (None, "torch"):
        runs["torch"] = torch_loop(batches, args, precision)
    warm = {side: timed(run, args.warmup) for side, run in runs.items()}
    chunk = max(1, args.steps // args.rounds)
    seconds = {side: 0.0 for side in runs}
    for round_ in range(args.rounds):
        order = list(runs.items())
        for side, run in order if round_ % 2 == 0 else order[::-1]:
            seconds[side] += timed(run, chunk)
    for close in closers:
        close()
    steps = chunk * args.rounds
    batch = args.batch_per_env * len(TRAIN_ENVS)
    sides = ("torch", "ours")
    rate = {side: steps / seconds[side] for side in runs}
    per_s = {s: f"{rate[s]:.2f}" if s in rate else "n/a" for s in sides}
    images = {s: f"{rate[s] * batch:,.0f}" if s in rate else "n/a" for s in sides}
    warm_s = {s: f"{warm[s]:.1f}" if s in warm else "n/a" for s in sides}
    ratio = f"{rate['ours'] / rate['torch']:.2f}" if len(rate) == 2 else "n/a"
    report.append(
        f"| {theirs_name} / {ours_dtype} | {steps} | {per_s['torch']} | {per_s['ours']} "
        f"| {images['torch']} | {images['ours']} | {ratio} | {warm_s['torch']} / "
        f"{warm_s['ours']} | {setup} |"
    )
    print(report[-1], flush=True)


def main():
    import torch

    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device,
                        help=f"PyTorch's device (default here: {default_device})")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS),
                        default=["fp32", "bf16"])
    parser.add_argument("--arch", default="resnet50", choices=("resnet18", "resnet50"))
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_per_env", type=int, default=32)
    parser.add_argument("--workers", type=int, default=16,
                        help="DataLoader workers per training domain (DomainBed: N_WORKERS)")
    parser.add_argument("--threads", type=int, default=None,
                        help="PyTorch's intra-op threads (default: torch's own)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per side and pair")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--images_per_class", type=int, default=40)
    parser.add_argument("--torch_loss_every", type=int, default=1)
    parser.add_argument("--no-cudnn_benchmark", dest="cudnn_benchmark", action="store_false")
    parser.add_argument("--only", choices=("torch", "ours"), default=None,
                        help="run one side alone (if the two frameworks cannot share a process)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    args.threads = args.threads or torch.get_num_threads()
    tmp = tempfile.mkdtemp(prefix="race_loop_")
    folder = os.path.join(tmp, "data")
    start = time.perf_counter()
    bench_input.write_tree(folder, 227, 227, args.images_per_class)
    written = time.perf_counter() - start
    # The DataLoaders' workers are forked here, before JAX starts its threads (a fork
    # after that is what JAX warns against); both precision pairs draw from them.
    batches = None if args.only == "ours" else torch_batches(folder, args, pin_memory=cuda)
    if cuda:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    else:
        import sagm_jax.cpu

        sagm_jax.cpu.configure()  # before JAX starts its backend
    import jax
    import torchvision

    backend = jax.devices()[0]
    where = torch.cuda.get_device_name() if cuda else "the CPU"
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch "
        f"{torch.__version__} + torchvision {torchvision.__version__} on {where} "
        f"({args.threads} threads, cudnn.benchmark {torch.backends.cudnn.benchmark if cuda else 'n/a'}); "
        f"jax {jax.__version__} on {backend.platform}: {backend.device_kind}"
    )
    batch = args.batch_per_env * len(TRAIN_ENVS)
    print(
        f"\n## The whole loop: SAGM, {args.arch} {args.image_size}x{args.image_size}, batch "
        f"{batch} ({args.batch_per_env} x {len(TRAIN_ENVS)} domains); PyTorch: DataLoader, "
        f"{args.workers} workers per domain, DomainBed's transforms, loss read every "
        f"{args.torch_loss_every} step(s); ours: store -> prefetch -> device augmentation, "
        f"loss read every {OUR_LOSS_EVERY}; {args.warmup} warm-up steps, then {args.rounds} "
        f"alternating rounds\n"
        f"folder: 4 domains x 7 classes x {args.images_per_class} JPEGs of 227x227, written in "
        f"{written:.1f} s"
    )
    print("| PyTorch / ours | steps | PyTorch steps/s | ours steps/s | PyTorch img/s "
          "| ours img/s | ours / PyTorch | warm-up s PyTorch / ours | our setup s (store, model) |")
    print("|---|---|---|---|---|---|---|---|---|")
    report = []
    try:
        for precision in args.precisions:
            race(folder, os.path.join(tmp, "cache"), batches, args, precision, report)
    finally:
        del batches  # ends the DataLoaders' workers
        shutil.rmtree(tmp, ignore_errors=True)
    print("(our setup: the first pair's includes building the decoded store; later pairs "
          "read it)")


if __name__ == "__main__":
    main()
