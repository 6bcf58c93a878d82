"""The one place that makes an engine's KV cache kind, once, from its placement: the kind that
`jaxrl.model.kernels.cache_kind` names for the platform of the mesh's devices (`jaxrl.model.kernels.platform_of`:
the devices decide, so `jaxrl compile`'s TPU programs traced on a CPU host get the TPU's kind), the model and
`kv_cache_tokens`.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxrl.kv.chunked import Chunked
from jaxrl.kv.kind import CacheKind
from jaxrl.kv.paged import Paged
from jaxrl.kv.ragged import RaggedPaged
from jaxrl.kv.triton import PagedTriton
from jaxrl.model import kernels
from jaxrl.model.config import ModelConfig
from jaxrl.model.kernels import Cache


def kind_for(platform: str, cfg: ModelConfig, slots: int, max_seq_len: int,
             kv_cache_tokens: int | None = None) -> CacheKind:
    """The cache of an engine of `slots` slots and `max_seq_len` positions on `platform`
    (`jaxrl.model.kernels.platform_of`), the kind `jaxrl.model.kernels.cache_kind` names: on an accelerator or
    with `kv_cache_tokens`, a paged pool of that many positions (None: `slots` x `max_seq_len`, at most what
    its slots ever hold; a run sizes it to what fits first, `jaxrl.compile.pool.sized`), `RaggedPaged` (TPU's:
    JAX's ragged paged-attention kernel, one compiled step for prompt chunks and decode tokens alike),
    `PagedTriton` or the gather-based `Paged`; else `Chunked`. `Dense`, the stacked cache on an accelerator,
    and `PagedPallas` (JAX's decode-only TPU paged-attention kernel) are given to the engine explicitly
    (`Engine(kv=...)`).

    Raises:
        ValueError: a pool too small for one sequence (`jaxrl.kv.paged.pool_pages`).
    """
    match kernels.cache_kind(platform, cfg.head_dim, kv_cache_tokens is not None):
        case Cache.CHUNKED:
            return Chunked(cfg, slots, max_seq_len)
        case Cache.RAGGED_TPU:
            return RaggedPaged(cfg, slots, max_seq_len, kv_cache_tokens)
        case Cache.PAGED_GPU:
            return PagedTriton(cfg, slots, max_seq_len, kv_cache_tokens)
        case Cache.PAGED:
            return Paged(cfg, slots, max_seq_len, kv_cache_tokens)


def pick(cfg: ModelConfig, mesh: Mesh, slots: int, max_seq_len: int, kv_cache_tokens: int | None = None) -> CacheKind:
    """`kind_for` the platform of `mesh`'s devices."""
    return kind_for(kernels.platform_of(mesh), cfg, slots, max_seq_len, kv_cache_tokens)
