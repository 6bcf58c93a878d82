"""One ragged step: a flat batch of M tokens from any mix of sequences (a decode slot's one new token, a
chunk of a prompt), each at its own position, through every layer at once, as vLLM V1 and tpu-inference
schedule chunked prefill. The tokens' keys and values go into a paged cache and each token attends over its
own sequence's positions up to its own; how is the cache kind's (`jaxrl.kv.ragged.RaggedPaged`, whose
attention is JAX's Pallas ragged paged-attention kernel on TPU).

Everything else is the training forward's own code (`blocks.attention_inputs`, `decode.layer_out`), run
over the M tokens as one row of a [1, M] batch. Letters as in `jaxrl.model.decoder`; M the flat tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.model import blocks, decoder
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.decode import layer_out
from jaxrl.model.decoder import KVCache, LayerWeights

# attend(q_MNH, k_MKH, v_MKH, cache, layer) -> (attention [M, N, H], the cache with the tokens' keys and values
# written at `layer`, an int32 scalar)
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def ragged_step(cfg: ModelConfig, params: Params, tokens_M: jax.Array, positions_M: jax.Array, cache: KVCache,
                attend: Attend, *, lora: Params | None = None, lora_scale: float = 0.0, mesh: Mesh | None = None,
                layers: list[LayerWeights] | None = None) -> tuple[jax.Array, KVCache]:
    """Final-norm hidden states of `tokens_M` (int32 [M]) at `positions_M` (int32 [M], each its sequence's
    position), and the cache with their keys and values written: per layer, `attend` writes the layer's
    keys and values of every token and attends (q unscaled, float in the params' dtype), the cache the layer
    loop's carry (written in place). The layers scan over the stacks (`decoder.scan_runs`), or run unrolled
    over `layers` (per layer `LayerWeights`, as `jaxrl.model.decode.decode_step`'s: `jaxrl compile`'s cost
    of one layer).

    Returns:
        hidden states [M, D] in the params' dtype, and the cache.
    """
    x_BTD = params["embed"][tokens_M][None]
    positions_BT = positions_M[None]

    def layer(kind, carry, weights, rows):
        x, c = carry
        (index,) = rows
        q_BTNH, k_BTKH, v_BTKH = blocks.attention_inputs(cfg, lora_scale, x, positions_BT, weights.attn,
                                                        weights.attn_lora)
        attn_MNH, c = attend(q_BTNH[0], k_BTKH[0], v_BTKH[0], c, index)
        return (layer_out(cfg, kind, lora_scale, mesh, x, attn_MNH[None].astype(x.dtype), weights), c), None

    if layers is None:
        (x_BTD, cache), _ = decoder.scan_runs(cfg, layer, (x_BTD, cache), params, lora,
                                            (jnp.arange(cfg.num_layers, dtype=jnp.int32),))
    else:
        for i, (kind, weights) in enumerate(zip(cfg.layer_kinds, layers, strict=True)):
            (x_BTD, cache), _ = layer(kind, (x_BTD, cache), weights, (jnp.int32(i),))
    return blocks.rms_norm(x_BTD[0], params["final_norm"], cfg.rms_norm_eps), cache
