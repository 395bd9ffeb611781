"""torchvision ResNet checkpoints: reading them, and mapping them onto our variables.

This module owns everything between a torchvision weights file and our Flax
variables:

* ``WEIGHTS_FILES`` and ``weights_url(arch)``: which file of torchvision's each
  architecture starts from, and where it is downloaded.
* ``weights_file_problem(path)`` says, from a few bytes of the file, why it is not a
  weights file of an accepted format (checked before a run, before the data is read).
* ``load_weights(path)`` reads a state dict from a torchvision ``.pth`` (with
  torch, the optional extra ``sagm_jax[torch]``), or from a ``.safetensors`` or
  ``.npz`` file (no torch), and returns it with the file's SHA-256, so every run
  can report which weights it started from.
* ``torchvision_layout(arch, num_classes)`` is the table of torchvision's keys, in
  torchvision's ``state_dict()`` order, with their shapes and where each lands in
  our variables.
* ``convert_torchvision(state_dict)`` maps a state dict onto
  ``{'params': ..., 'batch_stats': ...}`` strictly: a missing, unexpected or
  mis-shaped key is an error that names the keys. ``*.num_batches_tracked``
  entries (BatchNorm's step counters) carry no weights and are ignored. The
  ``fc.*`` keys become the ``classifier`` of the ImageNet network; a state dict
  with neither ``fc.weight`` nor ``fc.bias`` (a backbone alone, as self-supervised
  checkpoints are) converts to variables without a ``classifier``.
* ``with_pretrained_backbone(variables, converted)`` puts converted weights into
  freshly initialised DomainBed variables: every backbone entry is replaced
  (strictly), the fresh classifier is kept, and the converted ``classifier`` (the
  ImageNet fc) is deliberately dropped, as DomainBed removes torchvision's fc. A
  network of other than 3 input channels (ARM's) gets the stem's channel ``i % 3``
  as its channel i, as DomainBed's ``ResNet`` does.
* ``imagenet_classifier(arch, state_dict)`` is the ImageNet network in eval mode,
  for checking a weights file against known predictions.

Layouts: torch convolution weights are [out, in, kh, kw] and Flax kernels
[kh, kw, in, out]; torch linear weights are [out, in] and Flax kernels [in, out].
BatchNorm ``weight``/``bias`` are our ``scale``/``bias`` params and
``running_mean``/``running_var`` our ``mean``/``var`` batch statistics.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from sagm_jax.models.resnet import ARCHITECTURES, EXPANSION, STAGE_WIDTHS

TORCH_INSTALL_HINT = (
    "Reading a torchvision .pth file needs torch, which is an optional extra: "
    "install it with `pip install 'sagm_jax[torch]'` (a CPU build is enough), or, on "
    "any machine that has torch, convert the file once with "
    "`python -m sagm_jax.models.convert {path} weights.safetensors` and load the "
    ".safetensors file here; it needs no torch."
)
# torch.save files: .pth/.pt (torchvision), .bin (the Hugging Face hub's pytorch_model.bin),
# .pth.tar (training checkpoints such as MoCo v3's, a dict holding the state_dict), .torch
# (SWAG's torch.hub files).
SUPPORTED_SUFFIXES = (".pth", ".pt", ".bin", ".pth.tar", ".torch", ".safetensors", ".npz")
IGNORED_SUFFIX = ".num_batches_tracked"
# How many key names an error message lists before it summarises the rest.
MAX_KEYS_IN_MESSAGE = 20
# torchvision's IMAGENET1K_V1 weights, the ones DomainBed starts from (the hex in a
# name is the start of the file's SHA-256).
WEIGHTS_FILES = {"resnet50": "resnet50-0676ba61.pth", "resnet18": "resnet18-f37072fd.pth"}


def weights_url(arch: str) -> str:
    """Where torchvision's ImageNet weights for ``arch`` (a key of ``WEIGHTS_FILES``)
    are downloaded from."""
    return "https://download.pytorch.org/models/" + WEIGHTS_FILES[arch]


@dataclass(frozen=True)
class LayoutEntry:
    """One torchvision tensor: its key, shape, and its place in our variables."""

    torch_key: str
    shape: tuple[int, ...]
    collection: str  # 'params' or 'batch_stats'
    path: tuple[str, ...]  # module path and variable name inside the collection
    kind: str  # 'conv', 'linear' or 'vector' (as it is): how the array is transposed (convert_layout)


def _conv_entries(torch_module: str, flax_module: tuple[str, ...], out_ch: int, in_ch: int, k: int):
    return [
        LayoutEntry(
            f"{torch_module}.weight",
            (out_ch, in_ch, k, k),
            "params",
            flax_module + ("kernel",),
            "conv",
        )
    ]


def _bn_entries(torch_module: str, flax_module: tuple[str, ...], channels: int):
    shape = (channels,)
    return [
        LayoutEntry(f"{torch_module}.weight", shape, "params", flax_module + ("scale",), "vector"),
        LayoutEntry(f"{torch_module}.bias", shape, "params", flax_module + ("bias",), "vector"),
        LayoutEntry(
            f"{torch_module}.running_mean", shape, "batch_stats", flax_module + ("mean",), "vector"
        ),
        LayoutEntry(
            f"{torch_module}.running_var", shape, "batch_stats", flax_module + ("var",), "vector"
        ),
    ]


def torchvision_layout(arch: str, num_classes: int = 1000) -> list[LayoutEntry]:
    """torchvision's ``state_dict()`` keys for ``arch``, in its order, without counters."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown ResNet arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    block_kind, stage_sizes = ARCHITECTURES[arch]
    expansion = EXPANSION[block_kind]
    entries = _conv_entries("conv1", ("conv1",), 64, 3, 7) + _bn_entries("bn1", ("bn1",), 64)
    in_ch = 64
    for stage, (width, blocks) in enumerate(zip(STAGE_WIDTHS, stage_sizes), start=1):
        for index in range(blocks):
            stride = 2 if stage > 1 and index == 0 else 1
            torch_block, flax_block = f"layer{stage}.{index}", f"layer{stage}_{index}"
            if block_kind == "basic":
                convs = [(width, in_ch, 3), (width, width, 3)]
            else:
                convs = [(width, in_ch, 1), (width, width, 3), (width * expansion, width, 1)]
            for number, (out_ch, conv_in, k) in enumerate(convs, start=1):
                entries += _conv_entries(
                    f"{torch_block}.conv{number}", (flax_block, f"conv{number}"), out_ch, conv_in, k
                )
                entries += _bn_entries(
                    f"{torch_block}.bn{number}", (flax_block, f"bn{number}"), out_ch
                )
            out_ch = width * expansion
            if stride != 1 or in_ch != out_ch:
                entries += _conv_entries(
                    f"{torch_block}.downsample.0", (flax_block, "downsample_conv"), out_ch, in_ch, 1
                )
                entries += _bn_entries(
                    f"{torch_block}.downsample.1", (flax_block, "downsample_bn"), out_ch
                )
            in_ch = out_ch
    entries += [
        LayoutEntry(
            "fc.weight", (num_classes, in_ch), "params", ("classifier", "kernel"), "linear"
        ),
        LayoutEntry("fc.bias", (num_classes,), "params", ("classifier", "bias"), "vector"),
    ]
    return entries


def _name_keys(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:MAX_KEYS_IN_MESSAGE])
    more = len(keys) - MAX_KEYS_IN_MESSAGE
    return shown + (f" ... and {more} more" if more > 0 else "")


def infer_arch(state_dict: Mapping[str, Any]) -> str:
    """'resnet50' when the blocks have a third conv (bottlenecks), otherwise 'resnet18'."""
    return "resnet50" if "layer1.0.conv3.weight" in state_dict else "resnet18"


def convert_torchvision(state_dict: Mapping[str, Any], arch: str | None = None) -> dict[str, dict]:
    """Map a torchvision ResNet state dict onto ``{'params': ..., 'batch_stats': ...}``.

    ``state_dict`` maps torchvision key names to arrays (NumPy, or anything
    ``np.asarray`` reads). ``arch`` defaults to the one the keys imply. The number
    of classes is read from ``fc.weight``. Strict: every key of torchvision's
    layout must be present with its exact shape and no other key may appear,
    except ``*.num_batches_tracked``, which is ignored; the ``fc`` pair may be absent
    together (a backbone alone: no ``classifier`` then). Errors name the keys.
    """
    arch = arch or infer_arch(state_dict)
    fc_weight = state_dict.get("fc.weight")
    num_classes = (
        int(np.shape(fc_weight)[0]) if fc_weight is not None and np.ndim(fc_weight) == 2 else 1000
    )
    layout = torchvision_layout(arch, num_classes)
    if "fc.weight" not in state_dict and "fc.bias" not in state_dict:  # a backbone alone
        no_fc = [entry for entry in layout if not entry.torch_key.startswith("fc.")]
        return convert_layout(state_dict, no_fc, f"torchvision {arch} without fc")
    return convert_layout(state_dict, layout, f"torchvision {arch}")


def convert_layout(
    state_dict: Mapping[str, Any], layout: list[LayoutEntry], description: str
) -> dict[str, dict]:
    """Map ``state_dict`` onto ``{'params': ..., 'batch_stats': ...}`` by ``layout``.

    Strict: every key of the layout must be present with its exact shape and no other
    key may appear, except ``*.num_batches_tracked``, which is ignored. Errors name the
    keys and ``description`` (the network the layout is of). Each array becomes
    float32: a ``conv`` weight [out, in, kh, kw] becomes the kernel [kh, kw, in, out]
    (grouped convolutions alike: [out, in / groups, ...]), a ``linear`` weight
    [out, in] the kernel [in, out], and a ``vector`` (any other array) stays as it is.
    """
    expected = {entry.torch_key for entry in layout}
    given = {key for key in state_dict if not key.endswith(IGNORED_SUFFIX)}
    problems = []
    if missing := expected - given:
        problems.append(f"missing keys ({len(missing)}): {_name_keys(missing)}")
    if unexpected := given - expected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_name_keys(unexpected)}")
    misshaped = [
        f"{entry.torch_key} has shape {tuple(np.shape(state_dict[entry.torch_key]))}, expected {entry.shape}"
        for entry in layout
        if entry.torch_key in given and tuple(np.shape(state_dict[entry.torch_key])) != entry.shape
    ]
    if misshaped:
        problems.append(
            f"mis-shaped keys ({len(misshaped)}): " + "; ".join(misshaped[:MAX_KEYS_IN_MESSAGE])
        )
    if problems:
        raise ValueError(f"state dict does not match {description}: " + " | ".join(problems))

    variables: dict[str, dict] = {"params": {}, "batch_stats": {}}
    for entry in layout:
        array = np.asarray(state_dict[entry.torch_key], dtype=np.float32)
        if entry.kind == "conv":
            array = array.transpose(2, 3, 1, 0)
        elif entry.kind == "linear":
            array = array.T
        node = variables[entry.collection]
        for name in entry.path[:-1]:
            node = node.setdefault(name, {})
        node[entry.path[-1]] = np.ascontiguousarray(array)
    return variables


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix + (name,)))
        else:
            flat[prefix + (name,)] = value
    return flat


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return tree


STEM_KERNEL = ("params", "conv1", "kernel")


def _stem_for_channels(source: dict, fresh: dict) -> dict:
    """``source`` with its stem convolution fitted to the model's input channels, as
    DomainBed's ``ResNet`` (``domainbed/networks.py``) does for a network of ``nc != 3``
    input channels (ARM's context channel): input channel i of the kernel
    [kh, kw, nc, out] is the pretrained channel ``i % 3``. Unchanged when the channels
    agree, or when either has no stem kernel."""
    if STEM_KERNEL not in source or STEM_KERNEL not in fresh:
        return source
    kernel = np.asarray(source[STEM_KERNEL])
    channels = np.shape(fresh[STEM_KERNEL])[2]
    if kernel.ndim != 4 or kernel.shape[2] == channels:
        return source
    fitted = kernel[:, :, np.arange(channels) % kernel.shape[2], :]
    return {**source, STEM_KERNEL: fitted}


def with_pretrained_backbone(
    variables: Mapping, converted: Mapping, head: str = "classifier"
) -> dict:
    """Fresh ``variables`` with every backbone entry taken from ``converted``.

    Every entry of ``variables`` outside ``params[head]`` must exist in
    ``converted`` with the same shape, and ``converted`` may have nothing else
    besides its own ``params[head]`` (the ImageNet fc, deliberately dropped). A model
    built for other than 3 input channels takes the pretrained stem's channel
    ``i % 3`` as its channel i (``_stem_for_channels``, DomainBed's rule).
    Mismatches are errors naming the entries. The fresh head is kept as it is.
    """

    def is_head(path):
        return path[0] == "params" and path[1] == head

    fresh = _flatten(variables)
    source = _stem_for_channels(_flatten(converted), fresh)
    fresh_backbone = {path for path in fresh if not is_head(path)}
    source_backbone = {path for path in source if not is_head(path)}
    problems = []
    if missing := fresh_backbone - source_backbone:
        problems.append(
            f"missing from the converted weights: {_name_keys('/'.join(p) for p in missing)}"
        )
    if unexpected := source_backbone - fresh_backbone:
        problems.append(f"not in the model: {_name_keys('/'.join(p) for p in unexpected)}")
    misshaped = [
        f"{'/'.join(path)}: converted {tuple(np.shape(source[path]))}, model {tuple(np.shape(fresh[path]))}"
        for path in sorted(fresh_backbone & source_backbone)
        if tuple(np.shape(source[path])) != tuple(np.shape(fresh[path]))
    ]
    if misshaped:
        problems.append("mis-shaped: " + "; ".join(misshaped[:MAX_KEYS_IN_MESSAGE]))
    if problems:
        raise ValueError("pretrained weights do not fit the model: " + " | ".join(problems))
    merged = {
        path: (value if is_head(path) else np.asarray(source[path], dtype=np.asarray(value).dtype))
        for path, value in fresh.items()
    }
    return _unflatten(merged)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# What each accepted extension holds, as the "not a weights file" message lists it.
ACCEPTED_FORMATS = (
    ".pth/.pt/.bin/.pth.tar/.torch (torch.save: a zip archive, or a pickle before torch 1.6), "
    ".safetensors, "
    ".npz (a NumPy zip archive)"
)
# A .safetensors header is a few KB for a ResNet; a larger length is not a header.
MAX_SAFETENSORS_HEADER = 100 << 20


def _zip_problem(path: str, head: bytes, expected: str) -> str | None:
    if not head.startswith(b"PK\x03\x04"):
        return f"{expected}; this one starts with {head[:8]!r}"
    if not zipfile.is_zipfile(path):  # the archive's directory is at its end
        return "it is a zip archive cut short (no central directory at its end: truncated?)"
    return None


def _safetensors_problem(path: str, head: bytes, size: int) -> str | None:
    length = int.from_bytes(head[:8], "little")
    if size < 8 or length > min(size - 8, MAX_SAFETENSORS_HEADER) or head[8:9] != b"{":
        return (
            "a .safetensors file starts with its header's length (8 bytes, little-endian) "
            f"and a JSON header '{{...}}'; this one starts with {head[:12]!r} and holds "
            f"{size} bytes"
        )
    with open(path, "rb") as handle:
        handle.seek(8)
        try:
            header = json.loads(handle.read(length))
            tensors = [t for k, t in header.items() if k != "__metadata__"]
            end = max((t["data_offsets"][1] for t in tensors), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its .safetensors header is not the JSON object of tensors it should be"
    if 8 + length + end > size:
        held = size - 8 - length
        return f"its header lists {end} bytes of tensors but the file holds {held}: truncated?"
    return None


def weights_file_problem(path: str | os.PathLike) -> str | None:
    """Why the existing file ``path`` is not a weights file that :func:`load_weights`
    reads (its extension, its first bytes, a zip's directory or a .safetensors header
    against its size), or None. Cheap: reads the header, never the tensors."""
    path = os.fspath(path)
    suffix = weights_suffix(path)
    if suffix not in SUPPORTED_SUFFIXES:
        return f"its extension {suffix or '(none)'!r} is not one of {', '.join(SUPPORTED_SUFFIXES)}"
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(16)
    if not head:
        return "it is empty"
    if suffix == ".safetensors":
        return _safetensors_problem(path, head, size)
    if suffix == ".npz":
        return _zip_problem(path, head, "a .npz is a zip archive (first bytes PK\\x03\\x04)")
    if head[:1] == b"\x80":  # a pickle's protocol byte: torch.save before torch 1.6
        return None
    expected = (
        f"a {suffix} is a zip archive (first bytes PK\\x03\\x04) or a pickle (first byte 0x80)"
    )
    return _zip_problem(path, head, expected)


def weights_suffix(path: str) -> str:
    """The file's format suffix, lower case: the longest of ``SUPPORTED_SUFFIXES`` it ends
    with (so ``.pth.tar``), else its last extension."""
    lower = path.lower()
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return suffix
    return os.path.splitext(lower)[1]


def _load_pth(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as error:
        raise ImportError(TORCH_INSTALL_HINT.format(path=path)) from error
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for a corrupt or foreign file
        loaded = _load_torchscript(torch, path)  # OpenAI's CLIP files: TorchScript archives
        if loaded is None:
            raise ValueError(
                f"{path}: torch.load cannot read it as a checkpoint ({error})") from error
    if isinstance(loaded, torch.jit.ScriptModule):  # torch.load handed it to torch.jit
        loaded = dict(loaded.state_dict())
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]  # a training checkpoint (MoCo v3's .pth.tar): its weights
    if not isinstance(loaded, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in loaded.values()
    ):
        raise ValueError(
            f"{path}: expected a state dict (a mapping of names to tensors, as torchvision "
            f"saves), got {type(loaded).__name__}"
        )
    return {key: value.detach().cpu().numpy() for key, value in loaded.items()}


def _load_torchscript(torch, path: str):
    """The state dict of a TorchScript archive (OpenAI's ``RN50.pt``, ``ViT-B-16.pt``,
    which its ``clip.load`` opens with ``torch.jit.load``), or None if it is not one."""
    try:
        return dict(torch.jit.load(path, map_location="cpu").state_dict())
    except Exception:  # not an archive torch.jit reads: the caller's message stands
        return None


def _load_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return dict(load_file(path))
    except Exception as error:  # safetensors raises its own error type for a bad header
        raise ValueError(f"{path}: not a readable .safetensors file ({error})") from error


def _load_npz(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except Exception as error:  # zipfile and numpy raise several types for a bad archive
        raise ValueError(f"{path}: not a readable .npz archive ({error})") from error


def load_weights(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], str]:
    """Read a state dict from ``.pth``/``.pt``/``.bin``/``.pth.tar``/``.torch`` (torch), ``.safetensors``
    or ``.npz``. A torch file holding a training checkpoint (a dict with a ``state_dict``
    entry, as MoCo v3's ``.pth.tar``) gives that entry's state dict.

    Returns the mapping from torchvision key names to NumPy arrays and the file's
    SHA-256 (hex), to record which weights a run started from.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    suffix = weights_suffix(path)
    readers: dict[str, Callable[[str], dict]] = {
        ".pth": _load_pth,
        ".pt": _load_pth,
        ".bin": _load_pth,
        ".pth.tar": _load_pth,
        ".torch": _load_pth,
        ".safetensors": _load_safetensors,
        ".npz": _load_npz,
    }
    if suffix not in readers:
        raise ValueError(
            f"{path}: unsupported weights format {suffix!r}; expected one of {SUPPORTED_SUFFIXES}"
        )
    return readers[suffix](path), file_sha256(path)


def save_weights(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write a state dict as ``.safetensors`` (with ``metadata``) or ``.npz``; return its SHA-256."""
    path = os.fspath(path)
    arrays = {key: np.ascontiguousarray(np.asarray(value)) for key, value in state_dict.items()}
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file(arrays, path, metadata=dict(metadata or {}))
    elif suffix == ".npz":
        np.savez(path, **arrays)
    else:
        raise ValueError(f"{path}: can only write .safetensors or .npz, not {suffix!r}")
    return file_sha256(path)


def imagenet_classifier(arch: str, state_dict: Mapping[str, Any]) -> Callable:
    """torchvision's ImageNet network in eval mode, from its state dict.

    Returns a jitted function from normalized NHWC float32 images [B, H, W, 3]
    (ImageNet mean/std) to the logits [B, 1000] (the number of classes is read from
    ``fc.weight``, 1000 for ImageNet checkpoints).
    """
    import jax

    from sagm_jax.models.resnet import ResNet

    variables = convert_torchvision(state_dict, arch=arch)
    num_classes = variables["params"]["classifier"]["kernel"].shape[1]
    model = ResNet(arch=arch, num_classes=num_classes)
    variables = jax.tree_util.tree_map(jax.numpy.asarray, variables)

    @jax.jit
    def logits(images):
        return model.apply(variables, images, train=False)

    return logits
