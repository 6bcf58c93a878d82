"""Which kernel runs each piece of the model on a placement: the one module that reads the platform.

The model, the KV cache's picker and the sampler ask here and nowhere else (tests/test_structure.py greps
jaxrl/model, jaxrl/inference and `jaxrl.kv.pick` for platform names and finds them only in this module):

  * `attention_kernel`: the training and prefill attention (`jaxrl.model.attention`): Pallas splash on TPU,
    cuDNN flash attention or XLA's on GPU, the einsum elsewhere;
  * `cache_kind`: the engine's KV cache (`jaxrl.kv.pick` makes the `Cache` it names): a paged pool on an
    accelerator, read by the Pallas ragged kernel on TPU, by the gather reference on GPU (its Pallas Triton kernel
    behind `PAGED_KERNEL_ON_GPU`); the CPU's chunked cache;
  * `sampler_search`: how the sampler finds its top_k / top_p thresholds (`jaxrl.inference.sampling`);
  * `pins_loop_layouts`: whether a loop of decode steps pins its weights' layouts (`jaxrl.inference.steps`);
  * `interpret`: whether a Pallas kernel runs in interpret mode (on a CPU mesh: the tests);
  * `ragged_all_to_all`: how the MoE block's ragged all-to-all runs (`jaxrl.model.moe_all_to_all`): XLA's
    collective, the CPU's emulation, or not at all where XLA's TPU compiler refuses it.

The platform is that of the mesh's devices (`platform_of`), not `jax.default_backend()`: `jaxrl compile`
traces TPU programs on a CPU host, over a TPU topology's devices.
"""

from __future__ import annotations

import enum
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.parallel.sharding import mesh_platform

Implementation = Literal["einsum", "splash", "cudnn", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = ("einsum", "splash", "cudnn", "xla")
MIN_KERNEL_T = 128  # shorter rows run the einsum: splash's key blocks are multiples of 128 with segment ids

PAGED_KERNEL_ON_GPU = False
"""Whether a GPU engine's paged pool is read by the Pallas Triton kernel (`jaxrl.kv.triton.PagedTriton`) rather
than by the gather reference (`jaxrl.kv.paged.Paged`). Off until `scripts/device_check.py`'s decode rows
"paged" (the gather) and "paged-kernel" measure the kernel faster on a GPU: it matches the gather in interpret
mode and lowers for CUDA (tests/test_paged_kernel.py), but no GPU has compiled or timed it yet."""
GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # `jax.Device.platform` of a GPU, by backend


class Cache(enum.Enum):
    """The kinds of KV cache `cache_kind` chooses between (the classes of `jaxrl.kv`)."""

    CHUNKED = "chunked"  # `jaxrl.kv.chunked.Chunked`: per-layer, head-major chunks (CPU)
    PAGED = "paged"  # `jaxrl.kv.paged.Paged`: a page pool read by a gather
    RAGGED_TPU = "ragged_tpu"  # `jaxrl.kv.ragged.RaggedPaged`: a pool read by Pallas' TPU ragged paged attention
    PAGED_GPU = "paged_gpu"  # `jaxrl.kv.triton.PagedTriton`: the pool read by Pallas' Triton paged attention


class Search(enum.Enum):
    """How the sampler finds the top_k and top_p thresholds (`jaxrl.inference.sampling`'s module docstring):
    the same thresholds either way."""

    BISECT = "bisect"
    TOP_K = "top_k"


class Ragged(enum.Enum):
    """How a ragged all-to-all runs on a mesh (`ragged_all_to_all`)."""

    NATIVE = "native"  # `jax.lax.ragged_all_to_all`
    EMULATED = "emulated"  # a dense all-to-all of padded slices (XLA:CPU has no ragged all-to-all)
    REFUSED = "refused"  # XLA's TPU compiler refuses it on this slice


# XLA's TPU compiler refuses a ragged all-to-all on v5e slices of more than 16 chips ("Ragged all-to-all is
# currently not supported in limited ICI routing settings"; libtpu of jax 0.10.2, a one-op program over
# every device compiled from a CPU host, 2026-11-27: v5litepod-32, -64 and -256 refused; v5litepod-8 and -16,
# v6e-8 to -256, v5p-8 to -64, v4-16 and -32 compiled): the most devices it compiles for, by device kind
RAGGED_ALL_TO_ALL_MOST = {"TPU v5 lite": 16}


def platform_of(mesh: Mesh | None) -> str:
    """The platform of `mesh`'s devices ("cpu", "tpu", "gpu", ...: `jax.Device.platform`); "cpu" for no
    mesh (a function traced without one runs the reference paths)."""
    return "cpu" if mesh is None else mesh_platform(mesh)


def default_platform() -> str:
    """The platform of JAX's default backend, for code traced without a mesh to ask of (the sampler's
    `search` None)."""
    return jax.default_backend()


def interpret(mesh: Mesh | None) -> bool:
    """Whether a Pallas kernel on `mesh` runs in interpret mode: on a CPU mesh or without one (tests; slow)."""
    return platform_of(mesh) == "cpu"


def ragged_all_to_all(mesh: Mesh) -> Ragged:
    """How `jaxrl.model.moe_all_to_all.ragged_all_to_all` runs on `mesh`: emulated on a CPU mesh (XLA:CPU has
    no ragged all-to-all: "HLO opcode `ragged-all-to-all` is not supported", jax 0.10.2), refused on the TPU
    slices `RAGGED_ALL_TO_ALL_MOST` lists, XLA's collective elsewhere."""
    if platform_of(mesh) == "cpu":
        return Ragged.EMULATED
    most = RAGGED_ALL_TO_ALL_MOST.get(mesh.devices.flat[0].device_kind)
    return Ragged.REFUSED if most is not None and mesh.devices.size > most else Ragged.NATIVE


def attention_kernel(on: str, t: int, dtype, head_dim: int, segmented: bool) -> Implementation:
    """The attention implementation (`jaxrl.model.attention`) for T = `t` tokens of `dtype` with heads of
    `head_dim` on platform `on` (`platform_of`): "splash" on TPU from `MIN_KERNEL_T` tokens with `head_dim` a
    multiple of 128 (the lanes of a TPU vreg: the kernel's blocks are [block, head_dim]; every Qwen3 has
    128); on GPU "cudnn" for unsegmented (`segmented` False) bfloat16/float16 rows with `head_dim` <= 128
    and a multiple of 8 (cuDNN flash attention's rule), else "xla"; "einsum" elsewhere."""
    if on == "tpu" and t >= MIN_KERNEL_T and head_dim % 128 == 0:
        return "splash"
    if on in GPU_PLATFORMS:
        if (not segmented and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
                and head_dim <= 128 and head_dim % 8 == 0):
            return "cudnn"
        return "xla"
    return "einsum"


def cache_kind(on: str, head_dim: int, pooled: bool, paged_kernel_on_gpu: bool = PAGED_KERNEL_ON_GPU) -> Cache:
    """The KV cache of an engine on platform `on` (`platform_of`) whose model has heads of `head_dim`;
    `pooled`: `[jax] kv_cache_tokens` was given. On an accelerator, or `pooled`, a paged pool: read by the
    TPU's Pallas ragged paged-attention kernel with heads of a multiple of 128 (its blocks are [page
    positions, head_dim] in a vreg's 128 lanes; one step for prompt chunks and decode tokens), by the
    Triton kernel on GPU where `paged_kernel_on_gpu`, else by the gather.
    Otherwise, on CPU, the chunked cache (faster there: docs/benchmarks.md)."""
    if not pooled and on == "cpu":
        return Cache.CHUNKED
    if on == "tpu" and head_dim % 128 == 0:
        return Cache.RAGGED_TPU
    if on in GPU_PLATFORMS and paged_kernel_on_gpu:
        return Cache.PAGED_GPU
    return Cache.PAGED


def pins_loop_layouts(on: str) -> bool:
    """Whether a loop of decode steps (`jaxrl.inference.steps.run_steps`) on platform `on` pins the weights'
    layouts inside its body to their arguments': on TPU, where XLA's layout assignment otherwise gives the
    loop's copy of each stacked weight the tiled layout the layer scan's dots want and relayouts the whole
    stack into it once before the loop (docs/benchmarks-log.md, 2026-11-28)."""
    return on == "tpu"


def sampler_search(on: str) -> Search:
    """The sampler's threshold search on platform `on`: the bisection on CPU, where `lax.top_k` sorts and won
    no clear margin; `lax.top_k` on accelerators, a bounded number of passes over [B, V]
    (`jaxrl.inference.sampling`'s module docstring counts them)."""
    return Search.BISECT if on == "cpu" else Search.TOP_K
