"""Small helpers of the image build (image/build.sh and the Dockerfile); standard library only.

``requirements``: pins a ``pip install --dry-run --report`` resolution of the eaas wheel as a
hash-checked requirements file. For the ``cpu`` variant it checks that the resolution took the CPU
build of torch (``+cpu``, from PyTorch's CPU index) and no ``nvidia-*`` or ``cuda-*`` wheel: PyPI's
torch for Linux is the CUDA build, whose ``import torch`` fails without those wheels (its
libtorch links libcudart, cuBLAS, cuDNN, NCCL, ... when it loads), so they cannot just be left out.

``runtime-config``: edits the ``config.json`` that ``umoci unpack`` wrote so that the OCI runtime
runs one command, without a terminal, on a read-only root filesystem, with no capabilities, as the
image's user (which it leaves as the image configured it).

``size``: the compressed size of an image in an OCI layout (manifest, config and layers).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

CUDA_ONLY = re.compile(r"^(nvidia|cuda)-")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(report_path: Path, variant: str, skip: str) -> list[str]:
    report = json.loads(report_path.read_text())
    lines: list[str] = []
    for item in report["install"]:
        name = _normalize(item["metadata"]["name"])
        version = item["metadata"]["version"]
        if name == skip:
            continue
        if variant == "cpu" and (CUDA_ONLY.match(name) or (name == "torch" and not version.endswith("+cpu"))):
            raise SystemExit(f"variant cpu resolved {name}=={version}: is PyTorch's CPU index reachable?")
        archive = item["download_info"].get("archive_info", {})
        digest = archive.get("hashes", {}).get("sha256") or archive.get("hash", "").removeprefix("sha256=")
        if not digest:
            raise SystemExit(f"{name}: the report gives no sha256 for {item['download_info']['url']}")
        lines.append(f"{name}=={version} --hash=sha256:{digest}")
    return sorted(lines)


def runtime_config(config_path: Path, args: list[str]) -> None:
    config = json.loads(config_path.read_text())
    process = config["process"]
    process["args"] = args
    process["terminal"] = False
    process["capabilities"] = {key: [] for key in process.get("capabilities", {})}
    process["noNewPrivileges"] = True
    config["root"]["readonly"] = True
    config_path.write_text(json.dumps(config, indent=2))


def size(layout: Path, tag: str) -> dict[str, int]:
    def blob(digest: str) -> Path:
        algorithm, hexdigest = digest.split(":", 1)
        return layout / "blobs" / algorithm / hexdigest

    index = json.loads((layout / "index.json").read_text())
    ref_name = "org.opencontainers.image.ref.name"
    refs = [m for m in index["manifests"] if m.get("annotations", {}).get(ref_name) == tag]
    if not refs:
        raise SystemExit(f"no tag {tag} in {layout}")
    manifest = json.loads(blob(refs[0]["digest"]).read_text())
    layers = [layer["size"] for layer in manifest["layers"]]
    return {
        "layers": len(layers),
        "layer_bytes": sum(layers),
        "total_bytes": refs[0]["size"] + manifest["config"]["size"] + sum(layers),
    }


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    sub = parser.add_subparsers(dest="command", required=True)
    req = sub.add_parser("requirements", help="pinned, hash-checked requirements from a pip report")
    req.add_argument("report", type=Path)
    req.add_argument("--variant", choices=["cpu", "cuda"], required=True)
    req.add_argument("--skip", default="eaas", help="the project itself, installed from its wheel")
    rc = sub.add_parser("runtime-config", help="make an unpacked bundle run one command")
    rc.add_argument("config", type=Path)
    rc.add_argument("args", nargs="+")
    sz = sub.add_parser("size", help="compressed size of a tagged image in an OCI layout")
    sz.add_argument("layout", type=Path)
    sz.add_argument("tag")
    ns = parser.parse_args()
    if ns.command == "requirements":
        print("\n".join(requirements(ns.report, ns.variant, _normalize(ns.skip))))
    elif ns.command == "runtime-config":
        runtime_config(ns.config, ns.args)
    else:
        print(json.dumps(size(ns.layout, ns.tag)))


if __name__ == "__main__":
    main()
