"""Hugging Face checkpoints (`config.json` + safetensors) of every registered family to and from jaxrl params.

A checkpoint folder holds `config.json` and either one `model.safetensors` or shards listed by
`model.safetensors.index.json`. HF stores each layer (and expert) separately and each Linear weight as
[out, in]; jaxrl stacks layers (and experts) on leading axes and keeps each weight as [in..., out...]
with heads split out (`jaxrl.model.modules.param_specs`). Which HF tensor holds which weight, and in
what layout, is the family's declaration (`jaxrl.model.family.WeightNames`: Qwen3's in
`jaxrl/model/qwen3/weights.py`, GLM-4.5's in `jaxrl/model/glm4_moe/weights.py`); this module reads and
writes any family's by it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy

from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.families import family
from jaxrl.model.family import FLAT
from jaxrl.model.modules import param_specs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One jaxrl weight and the HF tensors that store it: one per (layer, expert) index when stacked."""

    key: tuple[str, ...]  # path in the params pytree
    hf_name: str  # "{i}" stands for the layer index, "{e}" for the expert index
    shape: tuple[int, ...]  # our shape of one HF tensor (without the stack axes)
    n_in: int  # leading axes of `shape` that HF stores last (a Linear's input); 0: same layout; -1: flat
    layers: tuple[int, ...] | None  # layer index of each entry of the leading stack axis; None: unstacked
    experts: int = 0  # > 0: a second stack axis with one HF tensor per expert

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.n_in < 0:
            return (math.prod(self.shape),)
        if not self.n_in:
            return self.shape
        return math.prod(self.shape[self.n_in:]), math.prod(self.shape[: self.n_in])

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Our leading stack axes: (), (layers,) or (layers, experts)."""
        if self.layers is None:
            return ()
        return (len(self.layers), self.experts) if self.experts else (len(self.layers),)

    def entries(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, index into our stack axes) of every HF tensor of this weight."""
        if self.layers is None:
            return [(self.hf_name, ())]
        experts = range(self.experts) if self.experts else [None]
        return [(self.hf_name.format(i=i, e=e), (j,) if e is None else (j, e))
                for j, i in enumerate(self.layers) for e in experts]

    def to_ours(self, t: np.ndarray) -> np.ndarray:
        if self.n_in < 0:
            return t.reshape(self.shape)
        return t.T.reshape(self.shape) if self.n_in else t

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        if self.n_in < 0:
            return w.reshape(self.hf_shape)
        return w.reshape(self.hf_shape[::-1]).T if self.n_in else w


class _Stored(NamedTuple):
    """One HF tensor to write: entry `index` of `weight`'s stack axes, in `dtype`."""

    name: str
    tensor: _Tensor
    weight: Any
    index: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.tensor.hf_shape) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        w = np.asarray(self.weight[self.index] if self.index else self.weight)
        return np.ascontiguousarray(self.tensor.to_hf(w), dtype=self.dtype)


def _layout(cfg: ModelConfig) -> list[_Tensor]:
    """Every weight of `param_specs(cfg)` with its HF names and layouts (the family's `WeightNames`).

    Raises:
        ValueError: the family declares no HF name for one of the weights `cfg`'s options give.
    """
    dims = cfg.dims()
    names = family(cfg.family).weight_names
    layer_ids = {"layers": tuple(range(cfg.num_layers)), "mlp": cfg.mlp_layers, "moe": cfg.moe_layers}
    out = []
    for name, spec in param_specs(cfg).items():
        if name not in names.groups:
            hf_name, fan_in = names.top[name]
            assert spec.letters.startswith(fan_in), (name, spec.letters, fan_in)
            out.append(_Tensor((name,), hf_name, spec.shape(dims), len(fan_in), None))
            continue
        for wname, wspec in spec.items():
            if wname not in names.groups[name]:
                raise ValueError(f"the {cfg.family} family declares no HF name for the weight {name}/{wname} "
                                 f"(jaxrl/model/{cfg.family}/weights.py)")
            hf_name, fan_in = names.groups[name][wname]
            n_stack = 2 if "{e}" in hf_name else 1
            assert fan_in == FLAT or wspec.letters[n_stack:].startswith(fan_in), (wname, wspec.letters, fan_in)
            n_in = -1 if fan_in == FLAT else len(fan_in)
            out.append(_Tensor((name, wname), hf_name, wspec.shape(dims)[n_stack:], n_in, layer_ids[name],
                               cfg.num_experts if n_stack == 2 else 0))
    return out


def tensor_names(cfg: ModelConfig) -> dict[tuple[str, ...], list[tuple[str, tuple[int, ...]]]]:
    """For each weight of `param_specs(cfg)`, keyed by its path in the params (`("layers", "wq")`): the
    HF name of every tensor that stores it, with that tensor's index into the weight's stack axes
    (`()`, `(layer,)` or `(layer, expert)`), e.g. `("model.layers.3.self_attn.q_proj.weight", (3,))`."""
    return {t.key: t.entries() for t in _layout(cfg)}


def load_config(folder: str | Path) -> ModelConfig:
    """The architecture in `folder/config.json`.

    Raises:
        FileNotFoundError: the folder or its config.json does not exist.
        ValueError: config.json is not a supported config (see `ModelConfig.from_hf`).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint folder {folder} has no {CONFIG_FILE}")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-mapped views of every tensor in one safetensors file (bytes are read on first touch).

    safetensors' own numpy reader cannot return bfloat16, the dtype most checkpoints use, so the file is
    read here, following the format's spec: a little-endian u64 header size, a JSON header
    {name: {dtype, shape, data_offsets}}, then the tensors' bytes.
    """
    with path.open("rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
    header.pop("__metadata__", None)
    if not header:
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if end - begin != math.prod(info["shape"]) * dtype.itemsize or end > data.size:
            raise ValueError(f"{path}: tensor {name!r} has corrupt data offsets {info['data_offsets']}")
        out[name] = data[begin:end].view(dtype).reshape(info["shape"])
    return out


def _open_weights(folder: Path) -> dict[str, np.ndarray]:
    """HF name -> memory-mapped tensor, over `model.safetensors` or the shards its index lists."""
    single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
    if single.is_file():  # as transformers does, prefer the single file when both exist
        return _read_safetensors(single)
    if not index.is_file():
        raise FileNotFoundError(f"checkpoint folder {folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise FileNotFoundError(f"checkpoint folder {folder} lacks {shard}, listed in {INDEX_FILE}")
        tensors.update(_read_safetensors(folder / shard))
    return tensors


def _at(tree: Mapping[str, Any], key: tuple[str, ...]) -> Any:
    for k in key:
        tree = tree[k]
    return tree


def load_hf(folder: str | Path, dtype: Any = jnp.float32, *,
            shardings: Any | None = None) -> tuple[ModelConfig, Params]:
    """Read a HF checkpoint of a registered family into a params pytree with the structure of `param_specs(cfg)`.

    Weights are converted one at a time from memory-mapped files, so host memory peaks at the params
    plus one stacked weight.

    Args:
        folder: holds `config.json` and `model.safetensors` (or shards and `model.safetensors.index.json`).
        dtype: dtype of every returned array (the checkpoint's, e.g. bf16, is converted).
        shardings: optional pytree of `jax.sharding.Sharding` with the params' structure (e.g.
            `jaxrl.parallel.sharding.spec_shardings(param_specs(cfg), cfg.dims(), mesh)`; get `cfg` from
            `load_config`); each weight is placed with its sharding. None: the default device.

    Returns:
        The config and the params (embed [V, D], layers {wq [L, D, N, H], ...}, final_norm [D], and
        unembed [D, V] when the embeddings are not tied).

    Raises:
        FileNotFoundError: the folder, config.json, the weights, or a shard the index lists is missing.
        ValueError: config.json is not a supported architecture; a tensor is missing, has the wrong shape, or is not
            part of this architecture (the message names the tensor).
    """
    folder = Path(folder)
    cfg = load_config(folder)
    tensors = _open_weights(folder)
    layout = _layout(cfg)

    expected = {n for t in layout for n, _ in t.entries()}
    missing = sorted(expected - tensors.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint {folder}: tensor {missing[0]!r} is missing{more}")
    unused_tensor = family(cfg.family).unused_tensor
    unused = {n for n in tensors.keys() - expected if not unused_tensor(n, cfg.num_layers)}
    if cfg.tie_word_embeddings:
        unused.discard("lm_head.weight")  # some tied checkpoints store a copy of the embedding
    if unused:
        raise ValueError(f"checkpoint {folder}: tensors {sorted(unused)[:5]} are not part of a {cfg.family} "
                         f"model with this config.json ({len(unused)} in all)")

    np_dtype = np.dtype(dtype)
    params: Params = {}
    for t in layout:
        host = np.empty(t.stack_shape + t.shape, np_dtype)
        for name, index in t.entries():
            src = tensors[name]
            if tuple(src.shape) != t.hf_shape:
                raise ValueError(f"checkpoint {folder}: tensor {name!r} has shape {tuple(src.shape)}, "
                                 f"expected {t.hf_shape} from config.json")
            host[index] = t.to_ours(src)
        sharding = None if shardings is None else _at(shardings, t.key)
        value = jax.device_put(host, sharding)
        if len(t.key) == 2:
            params.setdefault(t.key[0], {})[t.key[1]] = value
        else:
            params[t.key[0]] = value
        del host
    return cfg, params


def umask_mode(mode: int) -> int:
    """`mode` (0o666 for a file, 0o777 for a folder) less the process's umask: what `open` and `mkdir`
    give. Python has no getter for the umask: it is read by setting a strict one and putting it back, so
    a file another thread creates meanwhile gets fewer permissions, never more."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mode & ~mask


def save_hf(folder: str | Path, cfg: ModelConfig, params: Params, *, max_shard_bytes: int | None = None,
            dtype: Any | None = None) -> list[Path]:
    """Write `params` as a HF checkpoint that its family's transformers class (`Qwen3ForCausalLM`,
    `Glm4MoeForCausalLM`, ...) `.from_pretrained` loads.

    Writes `config.json` (`cfg.to_hf()`) and `model.safetensors`, or, with `max_shard_bytes`, shards
    `model-0000k-of-0000n.safetensors` of at most that many bytes each (a tensor larger than the limit
    gets a shard of its own) plus `model.safetensors.index.json`. Weight files already in the folder
    are deleted first so that no stale shard or index is left beside the new ones.

    Args:
        params: the structure of `param_specs(cfg)` (jax or numpy arrays).
        dtype: dtype of the stored tensors; None keeps each weight's own dtype.

    Returns:
        The weight files written.

    Raises:
        ValueError: a weight is missing from `params` or has a shape other than `cfg` implies.
    """
    folder = Path(folder)
    entries: list[_Stored] = []
    for t in _layout(cfg):
        try:
            w = _at(params, t.key)
        except KeyError:
            raise ValueError(f"params lack the weight {'/'.join(t.key)}") from None
        want = t.stack_shape + t.shape
        if tuple(w.shape) != want:
            raise ValueError(f"params weight {'/'.join(t.key)} has shape {tuple(w.shape)}, expected {want}")
        out_dtype = np.dtype(dtype if dtype is not None else w.dtype)
        w = np.asarray(w)  # one device-to-host copy per weight, not one per layer and expert
        entries += [_Stored(name, t, w, index, out_dtype) for name, index in t.entries()]

    shards: list[list[_Stored]] = [[]]
    shard_bytes = 0
    for e in entries:
        if max_shard_bytes is not None and shards[-1] and shard_bytes + e.nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(e)
        shard_bytes += e.nbytes

    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:
        old.unlink(missing_ok=True)
    sharded = max_shard_bytes is not None
    files, weight_map, total = [], {}, 0
    for k, shard in enumerate(shards, start=1):
        path = folder / (f"model-{k:05d}-of-{len(shards):05d}.safetensors" if sharded else WEIGHTS_FILE)
        tensors = {e.name: e.array() for e in shard}
        safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
        path.chmod(umask_mode(0o666))  # safetensors creates its file 0600; every other file gets the umask's mode
        del tensors
        weight_map.update((e.name, path.name) for e in shard)
        total += sum(e.nbytes for e in shard)
        files.append(path)
    if sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    hf = cfg.to_hf()
    hf["torch_dtype"] = np.dtype(dtype if dtype is not None else _at(params, ("embed",)).dtype).name
    (folder / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    return files
