"""The rollout engine's KV cache, in one package: each kind of cache is one class in one file that owns its
shapes and logical axes, its write, its gather and its decode attention (`kind.CacheKind`), and `pick` makes the
kind that `jaxrl.model.kernels.cache_kind`, the one place that reads the platform, names for the placement.

  * `dense.Dense`: one stacked [L, B, S, K, H] per k and v (TPU and GPU without a pool);
  * `chunked.Chunked`: per layer, head-major chunks (CPU);
  * `paged.Paged`: a page pool with a page table per slot, attended by a gather (`paged.gather`; CPU, GPU);
  * `pallas.PagedPallas`: the same pool attended by JAX's Pallas paged-attention kernel (TPU, given explicitly);
  * `ragged.RaggedPaged`: a pool in the layout of JAX's Pallas ragged paged-attention kernel, whose step takes
    any mix of prompt chunks and decode tokens (TPU);
  * `triton.PagedTriton`: the same pool attended by JAX's Pallas Triton paged-attention kernel (GPU, behind
    `jaxrl.model.kernels.PAGED_KERNEL_ON_GPU`).

`chunks` holds the chunk maths the kinds share; `pages` the host side of a paged pool (which pages a slot
holds). The decode step that runs over a kind is `jaxrl.model.decode.decode_step`.
"""
