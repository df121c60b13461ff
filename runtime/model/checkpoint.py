"""Checkpoints in the Hugging Face layout: ``config.json`` + sharded ``*.safetensors`` + index.

``write_random_checkpoint`` makes a random model of any ``MoEConfig``; ``CheckpointReader`` loads
only the tensors asked for (an expert server reads just its experts).
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from eaas.runtime.model.config import MoEConfig
from eaas.runtime.model.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    dequantize_fp8_blocks,
    fp8_block_size,
    is_fp8_quantized,
    quantize_fp8_blocks,
)
from eaas.runtime.model.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4
from eaas.runtime.model.naming import tensor_shapes

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORED_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.bfloat16,
}
READABLE_DTYPES = (*STORED_DTYPES, "U8")  # U8: MXFP4 blocks and scales


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or inconsistent."""


def created_file_mode() -> int:
    """The mode a file created now gets: 0666 less the process's umask (``open`` honours it;
    safetensors writes its files 0600 whatever the umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def unreadable(path: Path, exc: OSError) -> CheckpointError:
    """A ``CheckpointError`` that names ``path``, why it cannot be read, who asked and who owns it
    (a checkpoint written by root and mounted into pods of another user is the usual case)."""
    reason = exc.strerror or str(exc)
    try:
        st = path.stat()
        owner = f"; the file is mode {st.st_mode & 0o777:04o}, owner uid {st.st_uid} gid {st.st_gid}"
    except OSError:
        owner = ""
    return CheckpointError(
        f"{path}: cannot be read ({reason}; this process runs as uid {os.geteuid()} gid "
        f"{os.getegid()}{owner})"
    )


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random weights that keep activations of order one (so routing and logits are not flat)."""
    if name.endswith("_bias"):  # fused expert biases [E, N]
        return 0.1 * torch.randn(shape, generator=generator)
    if len(shape) == 1:
        if name.endswith(("e_score_correction_bias", ".bias")):
            return 0.1 * torch.randn(shape, generator=generator)
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)  # norm weights
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / math.sqrt(shape[1])


def write_random_checkpoint(
    config: MoEConfig,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int = 2 << 30,
    fp8_block: tuple[int, int] | None = None,
) -> Path:
    """Writes a random checkpoint of ``config`` to ``out_dir`` and returns the directory.

    ``fp8_block``: store projections as block-scaled FP8 the way DeepSeek's checkpoints do
    (``weight_scale_inv`` beside each, ``quantization_config`` in config.json).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: must be >= 1, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = DTYPES[dtype]
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    total_bytes = 0
    for name, shape in tensor_shapes(config).items():
        tensor = random_tensor(name, shape, generator).to(torch_dtype).contiguous()
        pieces = {name: tensor}
        if fp8_block is not None and is_fp8_quantized(name, shape):
            quantized, scale_inv = quantize_fp8_blocks(tensor, fp8_block)
            pieces = {name: quantized, name + SCALE_SUFFIX: scale_inv}
        size = sum(t.numel() * t.element_size() for t in pieces.values())
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1].update(pieces)
        shard_bytes += size
        total_bytes += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        (out / file_name).chmod(created_file_mode())  # readable as config.json is, by the pods' user
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    hf = config.to_hf_config()
    hf["torch_dtype"] = dtype
    if fp8_block is not None:
        hf["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
        }
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


class CheckpointReader:
    """Reads ``config.json`` and any subset of tensors of a Hugging Face-layout checkpoint.

    Every tensor read is checked against the shape the config gives it and against the dtypes
    EaaS reads; block-scaled FP8 weights (DeepSeek's ``weight_scale_inv``) are dequantised.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path}: not found (is this a checkpoint directory?)")
        try:
            text = config_path.read_text()
        except OSError as exc:
            raise unreadable(config_path, exc) from exc
        try:
            hf = json.loads(text)
            self.config = MoEConfig.from_hf_config(hf)
            self.fp8_block = fp8_block_size(hf)
            # Quantised weights dequantise to the dtype the checkpoint declares (bfloat16 if none).
            self.dequantized_dtype = DTYPES.get(
                hf.get("torch_dtype") or hf.get("dtype") or "", torch.bfloat16
            )
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from exc
        except ValueError as exc:
            raise CheckpointError(f"{config_path}: {exc}") from exc
        self.expected_shapes = tensor_shapes(self.config)
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except OSError as exc:
                raise unreadable(index_path, exc) from exc
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from exc
            return dict(weight_map)
        single = self.directory / "model.safetensors"
        if not single.is_file():
            raise CheckpointError(f"{self.directory}: neither {INDEX_FILE} nor model.safetensors found")
        with self._open(single) as f:
            return dict.fromkeys(f.keys(), single.name)

    def _open(self, path: Path) -> Any:
        try:
            with path.open("rb"):  # safetensors reports a refused open without saying why
                pass
        except OSError as exc:
            raise unreadable(path, exc) from exc
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for bad headers and sizes
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def stored_dtypes(self) -> dict[str, str]:
        """Name -> safetensors dtype (``F32``, ``BF16``, ``F8_E4M3``, ...) of every tensor, from the
        shard headers."""
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name, shard in self.weight_map.items():
            by_shard[shard].append(name)
        dtypes: dict[str, str] = {}
        for shard, names in sorted(by_shard.items()):
            with self._open(self.directory / shard) as f:
                present = set(f.keys())
                dtypes.update({n: f.get_slice(n).get_dtype() for n in names if n in present})
        return dtypes

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` loads as with ``dtype=None`` (FP8 and MXFP4 weights: ``dequantized_dtype``)."""
        if self.is_mxfp4(name):
            return self.dequantized_dtype
        if name not in self.weight_map:
            raise CheckpointError(f"{self.directory}: tensors not in checkpoint: {name}")
        with self._open(self.directory / self.weight_map[name]) as f:
            stored = f.get_slice(name).get_dtype()
        if stored == "F8_E4M3":
            return self.dequantized_dtype
        return STORED_DTYPES.get(stored, torch.float32)

    def load(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Loads ``names`` (opening only the shards that hold them), optionally cast to ``dtype``.

        FP8 weights come back dequantised to ``dtype`` (when None: the dtype config.json declares,
        else bfloat16).
        """
        return dict(self.iter_load(names, dtype))

    def iter_load(
        self, names: list[str], dtype: torch.dtype | None = None, progress: str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) shard by shard (see ``iter_load_slices``)."""
        for (name, _), tensor in self.iter_load_slices([(n, None) for n in names], dtype, progress):
            yield name, tensor

    def iter_load_slices(
        self,
        refs: list[tuple[str, int | None]],
        dtype: torch.dtype | None = None,
        progress: str | None = None,
        dequantize: bool = True,
    ) -> Iterator[tuple[tuple[str, int | None], torch.Tensor]]:
        """Yields ((name, index), tensor) shard by shard: the whole tensor for index None, else
        only ``tensor[index]`` (one expert of a per-layer tensor), so a caller can place each piece
        and drop it (peak memory: the result plus one piece). MXFP4 tensors (``<name>_blocks``
        and ``_scales``) are read in their place and dequantised. ``progress``: a tqdm bar with
        this label, shown when stderr is a terminal. ``dequantize=False``: FP8 weights come back
        as stored (ask for their ``_scale_inv`` tensors too), and ``dtype`` casts the others."""
        missing = [n for n, _ in refs if n not in self.weight_map and not self.is_mxfp4(n)]
        if missing:
            shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
            raise CheckpointError(f"{self.directory}: tensors not in checkpoint: {shown}")
        by_shard: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        for name, index in refs:
            by_shard[self.weight_map.get(name) or self.weight_map[name + BLOCKS_SUFFIX]].append((name, index))
        bar = tqdm(total=len(refs), desc=progress, unit="tensor", disable=None if progress else True)
        with bar:
            for shard, shard_refs in sorted(by_shard.items()):
                plain = [ref for ref in shard_refs if ref[0] in self.weight_map]
                raw = self._read(shard, plain)
                for ref in shard_refs:
                    if ref[0] not in self.weight_map:
                        tensor = self._read_mxfp4(ref, dtype or self.dequantized_dtype)
                    else:
                        tensor = raw.pop(ref)
                        if tensor.dtype == FP8_DTYPE:
                            if not dequantize:
                                yield ref, tensor
                                bar.update(1)
                                continue
                            scale = self._scale_of(ref[0], shard, raw)
                            tensor = self._dequantize(ref[0], tensor, scale, dtype or self.dequantized_dtype)
                        elif ref[0].endswith(SCALE_SUFFIX):
                            yield ref, tensor  # scales stay float32
                            bar.update(1)
                            continue
                    yield ref, tensor if dtype is None else tensor.to(dtype)
                    bar.update(1)

    def is_mxfp4(self, name: str) -> bool:
        return name + BLOCKS_SUFFIX in self.weight_map and name + SCALES_SUFFIX in self.weight_map

    def _read_mxfp4(self, ref: tuple[str, int | None], dtype: torch.dtype) -> torch.Tensor:
        """``name`` (or ``name[index]``) from its MXFP4 blocks and scales, in the layout the
        unquantised tensor has: [..., in, out] (the blocks are stored [..., out, in / 32, 16])."""
        name, index = ref
        blocks_name, scales_name = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
        blocks = self._read(self.weight_map[blocks_name], [(blocks_name, index)])[(blocks_name, index)]
        scales = self._read(self.weight_map[scales_name], [(scales_name, index)])[(scales_name, index)]
        expected = self.expected_shapes.get(name)
        try:
            values = dequantize_mxfp4(blocks, scales, dtype)  # [..., out, in]
        except ValueError as exc:
            raise CheckpointError(f"{self.directory}: {name}: {exc}") from exc
        values = values.transpose(-1, -2)
        want = expected if index is None or expected is None else expected[1:]
        if want is not None and tuple(values.shape) != tuple(want):
            raise CheckpointError(
                f"{self.directory}: MXFP4 tensor {name} dequantises to shape {tuple(values.shape)}, "
                f"expected {tuple(want)} from config.json"
            )
        return values.contiguous()

    def _scale_of(
        self, name: str, shard: str, raw: dict[tuple[str, int | None], torch.Tensor]
    ) -> torch.Tensor | None:
        scale_name = name + SCALE_SUFFIX
        if (scale_name, None) in raw:
            return raw[(scale_name, None)]
        if scale_name not in self.weight_map:
            return None
        return self._read(self.weight_map[scale_name], [(scale_name, None)])[(scale_name, None)]

    def _read(
        self, shard: str, refs: list[tuple[str, int | None]]
    ) -> dict[tuple[str, int | None], torch.Tensor]:
        """Tensors (or slices) ``refs`` of ``shard``, plus the FP8 scales of whole tensors that the
        shard holds."""
        path = self.directory / shard
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        tensors: dict[tuple[str, int | None], torch.Tensor] = {}
        with self._open(path) as f:
            present = set(f.keys())
            scales = [(n + SCALE_SUFFIX, None) for n, i in refs if i is None and n + SCALE_SUFFIX in present]
            for name, index in [*refs, *scales]:
                if name not in present:
                    raise CheckpointError(f"{path}: the index puts {name} here but the shard lacks it")
                tensor_slice = f.get_slice(name)
                self._check(path, name, tensor_slice)
                try:
                    if index is None:
                        tensors[(name, index)] = f.get_tensor(name)
                    else:
                        tensors[(name, index)] = tensor_slice[index : index + 1][0]
                except Exception as exc:
                    raise CheckpointError(f"{path}: cannot read {name} ({exc})") from exc
        return tensors

    def _check(self, path: Path, name: str, tensor_slice: Any) -> None:
        shape = tuple(tensor_slice.get_shape())
        stored = tensor_slice.get_dtype()
        expected = self.expected_shapes.get(name)
        if expected is not None and shape != expected:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {shape}, expected {expected} from config.json"
            )
        if stored not in READABLE_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name} is {stored}; readable dtypes are {', '.join(READABLE_DTYPES)}"
            )
        if stored == "U8" and not name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX)):
            raise CheckpointError(f"{path}: tensor {name} is U8, which only MXFP4 blocks and scales may be")
        if stored == "F8_E4M3" and not name.endswith(SCALE_SUFFIX) and self.fp8_block is None:
            raise CheckpointError(
                f"{path}: tensor {name} is FP8 but config.json has no fp8 quantization_config"
            )

    def _dequantize(
        self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        assert self.fp8_block is not None  # _check refused FP8 without a quantization_config
        if scale_inv is None:
            raise CheckpointError(f"{self.directory}: FP8 tensor {name} has no {name}{SCALE_SUFFIX}")
        try:
            return dequantize_fp8_blocks(weight, scale_inv, self.fp8_block, dtype)
        except ValueError as exc:
            raise CheckpointError(f"{self.directory}: {name}: {exc}") from exc
