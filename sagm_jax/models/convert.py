"""Convert a torchvision .pth checkpoint once into a file that needs no torch.

    python -m sagm_jax.models.convert resnet50-0676ba61.pth resnet50.safetensors

Run it on any machine with torch (``pip install 'sagm_jax[torch]'``). The output
(``.safetensors`` or ``.npz``, by its suffix) holds the same keys and arrays; it
is checked strictly against torchvision's ResNet layout before it is written. The
source file's SHA-256 is stored in the safetensors metadata (``source_sha256``)
and both digests are printed, so results can be traced to the original download.
"""

from __future__ import annotations

import argparse
import os

from sagm_jax.models.torchvision_weights import (
    convert_torchvision,
    infer_arch,
    load_weights,
    save_weights,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="torchvision checkpoint (.pth, .pt, .safetensors or .npz)")
    parser.add_argument("target", help="output file, .safetensors or .npz")
    args = parser.parse_args(argv)
    state_dict, source_sha256 = load_weights(args.source)
    arch = infer_arch(state_dict)
    convert_torchvision(state_dict, arch=arch)  # strict check: fails with the offending keys
    target_sha256 = save_weights(
        state_dict,
        args.target,
        metadata={
            "source_sha256": source_sha256,
            "source_name": os.path.basename(args.source),
            "arch": arch,
        },
    )
    print(f"{arch}: {len(state_dict)} arrays")
    print(f"source {args.source} sha256 {source_sha256}")
    print(f"target {args.target} sha256 {target_sha256}")


if __name__ == "__main__":
    main()
