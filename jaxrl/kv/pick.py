"""The one place that picks an engine's KV cache kind, once, from its placement: the platform of the mesh's
devices (`jaxrl.parallel.sharding.mesh_platform`: the devices decide, so `jaxrl compile`'s TPU programs
traced on a CPU host get the TPU's kind), the model and `kv_cache_tokens`.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxrl.kv.chunked import Chunked
from jaxrl.kv.kind import CacheKind
from jaxrl.kv.paged import Paged
from jaxrl.kv.pallas import PagedPallas
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import mesh_platform


def kind_for(platform: str, cfg: ModelConfig, slots: int, max_seq_len: int,
             kv_cache_tokens: int | None = None) -> CacheKind:
    """The cache of an engine of `slots` slots and `max_seq_len` positions on `platform` ("cpu", "tpu",
    "gpu", ...): on an accelerator or with `kv_cache_tokens`, a paged pool of that many positions (None:
    `slots` x `max_seq_len`, at most what its slots ever hold; a run sizes it to what fits first,
    `jaxrl.compile.pool.sized`): `PagedPallas` on TPU with heads of a multiple of 128 (the kernel's blocks
    are [page positions, head_dim] in a vreg's 128 lanes), else the gather-based `Paged`. Else, on CPU,
    `Chunked` (faster there). `Dense`, the stacked cache on an accelerator, is given to the engine
    explicitly (`Engine(kv=...)`).

    Raises:
        ValueError: a pool too small for one sequence (`jaxrl.kv.paged.pool_pages`).
    """
    if kv_cache_tokens is not None or platform != "cpu":
        paged = PagedPallas if platform == "tpu" and cfg.head_dim % 128 == 0 else Paged
        return paged(cfg, slots, max_seq_len, kv_cache_tokens)
    return Chunked(cfg, slots, max_seq_len)


def pick(cfg: ModelConfig, mesh: Mesh, slots: int, max_seq_len: int, kv_cache_tokens: int | None = None) -> CacheKind:
    """`kind_for` the platform of `mesh`'s devices."""
    return kind_for(mesh_platform(mesh), cfg, slots, max_seq_len, kv_cache_tokens)
