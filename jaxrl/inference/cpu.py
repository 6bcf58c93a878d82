"""The rollout engine's CPU tuning of its weights and sampling, behind one seam: `CpuWeights`, the
`jaxrl.inference.engine_params.EngineWeights` of an engine over the CPU's KV cache (`jaxrl.kv.chunked`,
which `jaxrl.kv.pick` picks on a CPU mesh; a TPU or GPU runs `engine_params.PlainWeights` over a paged pool).

Memory is plentiful on a CPU host and bandwidth is what a decode step spends, so the engine keeps its own
copy of the weights and a cache laid out for XLA's CPU backend (figures: docs/benchmarks.md, issues 4
and 13, gathered in 2026-11-26):
  * a per-layer copy of the layer weights (`decoder.unstack_layers` outside jit: each layer's slices their
    own arrays, since XLA's CPU backend copies a layer's weights out of a stack before each read), the
    projections and the unembedding output-major (`jaxrl.model.cpu.OutMajor`); prefills read it too;
  * (the KV cache per layer, head-major, in chunks that grow: `jaxrl.kv.chunked.Chunked`, which the
    per-layer copy is read with);
  * with `blocked_sampling`, a decode step that only applies a temperature samples without the [B, V]
    logits (`sample_unembedded`, over the unembedding's rows in blocks of their own, `vocab_blocks`):
    faster at a small hidden size and many slots only (`blocked_sampling_pays`). It draws from the same
    distribution with the same uniform as `jaxrl.inference.sampling.sample`: the unembedding runs over
    vocabulary blocks whose logits stay in cache, each leaving its chunk maxima and chunk sums (the online
    softmax, Milakov & Gimelshein 2018), and only the chosen chunk's logits are computed again for the draw.
Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.inference.engine_params import EngineParams
from jaxrl.inference.sampling import CHUNK, SlotSampling, pick_chunk, pick_within, sample
from jaxrl.model import cpu, decoder
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig

BLOCK = 8192  # vocabulary rows per block of `sample_unembedded` (a multiple of `sampling.CHUNK`)


def blocked_sampling_pays(cfg: ModelConfig, slots: int) -> bool:
    """Whether a temperature-only decode step samples faster with `sample_unembedded` on CPU: measured so
    at a hidden size of 256 and many slots only, slower at Qwen3-0.6B's 1024 (docs/benchmarks.md,
    2026-11-26). It never fires on a released Qwen3; it stays for the small-shape RL step against Tunix."""
    return cfg.hidden_size <= 256 and slots >= 16


@dataclasses.dataclass
class CpuWeights:
    """The CPU engine's weights and sampling (`jaxrl.inference.engine_params.EngineWeights`, see the module's
    docstring) for `cfg` and `slots` decode slots. `blocked_sampling` None: `blocked_sampling_pays`."""

    cfg: ModelConfig
    slots: int
    blocked_sampling: bool | None = None
    reads_training_weights = False

    def __post_init__(self) -> None:
        if self.blocked_sampling is None:
            self.blocked_sampling = blocked_sampling_pays(self.cfg, self.slots)
        self._base_views: tuple | None = None  # (the base they were made from, layers, unembedding, its blocks)

    def prepare(self, params: Params) -> EngineParams:
        """`EngineParams` of `{"base", "lora"}` with `layers`, the per-layer copy (projections output-major)
        with the LoRA's per-layer slices, `unembed`, the unembedding as an `OutMajor` [V, D] (a tied
        embedding read in place), and with `blocked_sampling` `unembed_blocks`, its rows in blocks (a
        copy). The base's views are reused while the same base object comes back (an RL run swaps only
        its LoRA)."""
        base = params["base"]
        if self._base_views is None or self._base_views[0] is not base:
            unembed = cpu.unembedding(base)
            blocks = vocab_blocks(unembed.w_OI) if self.blocked_sampling else None
            self._base_views = (base, cpu.out_major(self.cfg, decoder.unstack_layers(self.cfg, base)), unembed, blocks)
        _, base_layers, unembed, blocks = self._base_views
        lora = params.get("lora")
        layers = decoder.join_layers(base_layers, decoder.unstack_layers(self.cfg, lora))
        return EngineParams(base=base, layers=layers, lora=lora, unembed=unembed, unembed_blocks=blocks)

    def logits(self, params: EngineParams, hidden_BTD: jax.Array) -> jax.Array:
        """Through the prepared `OutMajor` unembedding (the base's where `prepare` did not run)."""
        return decoder.logits(_unembedding(params), hidden_BTD)

    def sample(self, params, hidden_BD, sampling, keys_B, *, truncate, seen_BV, ban_BV, search=None):
        """`sample_unembedded` with `blocked_sampling` when the step only applies a temperature, else
        `sample` of the logits."""
        if self.blocked_sampling and not truncate and seen_BV is None and ban_BV is None:
            w = decoder.unembed_matrix(_unembedding(params))
            rows_VD = w.w_OI if isinstance(w, cpu.OutMajor) else w.T  # tied: XLA cancels the two transposes
            return sample_unembedded(hidden_BD, rows_VD, sampling, keys_B, blocks=params.unembed_blocks)
        return sample(self.logits(params, hidden_BD[:, None])[:, 0], sampling, keys_B, truncate=truncate,
                      seen_BV=seen_BV, ban_BV=ban_BV, search=search)


def _unembedding(params: EngineParams) -> Params:
    """What `decoder.logits` reads: the prepared `OutMajor` unembedding, or the base's where `prepare` did not
    run (`EngineParams.of` the weights: the same numbers, slower)."""
    return params.base if params.unembed is None else {"unembed": params.unembed}


def vocab_blocks(unembed_VD: jax.Array, block: int = BLOCK) -> tuple[jax.Array, ...]:
    """The unembedding's rows [V, D] as `sample_unembedded`'s blocks: `block` rows each, the last shorter.
    Called outside jit (`CpuWeights.prepare`) each block is a copy in its own array, since XLA's CPU backend
    copies a block out of a larger array before every dot that reads it (docs/benchmarks.md, 2026-11-26)."""
    return tuple(unembed_VD[i:i + block] for i in range(0, unembed_VD.shape[0], block))


def _block_stats(l_vB: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Of scaled logits [v, B] (v a vocabulary block's rows, a multiple of `chunk`, padding at -inf), per
    chunk of `chunk` rows: the max [J, B] (J = v / chunk), and the sum of exp(l - the block's max) [J, B].
    Two fused passes over the logits (max, then exp-sum); no argmax, whose variadic (value, index) reduce
    cost XLA's CPU backend a sixth of a 32-row decode step."""
    v, b = l_vB.shape
    l_JCB = l_vB.reshape(v // chunk, chunk, b)
    m_JB = jnp.max(l_JCB, axis=1)
    return m_JB, jnp.sum(jnp.exp(l_JCB - jnp.max(m_JB, axis=0)[None, None]), axis=1)


def _scaled(h_BD: jax.Array, inv_t_B: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(h', post) such that `(rows @ h'.T) * post` are the logits over the temperature: a float32 `h_BD`
    is scaled by `inv_t_B` before the dots (post None: no pass over the logits); another dtype keeps its
    precision and its products are scaled (post `inv_t_B`)."""
    return (h_BD * inv_t_B[:, None], None) if h_BD.dtype == jnp.float32 else (h_BD, inv_t_B)


def _blocks_stats(h_BD, blocks_vD, post_B, chunk: int):
    """`_block_stats` of each vocabulary block's `rows_vD @ h_BD.T (* post_B)` (`_scaled`), unrolled over
    the blocks (each its own buffer): the chunk maxima [B, J] and the chunk weights [B, J] (the chunk sums
    scaled by exp(block max - row max)), J chunks of the whole vocabulary, and the row max [B]. A block
    short of whole chunks (the last) is padded at -inf."""
    maxima, sums = [], []  # per block: [J of the block, B]
    for rows_vD in blocks_vD:  # the rows as the dot's left operand, as `jaxrl.model.cpu.OutMajor`
        l_vB = jax.lax.dot_general(rows_vD, h_BD, (((1,), (1,)), ((), ()))).astype(jnp.float32)
        l_vB = l_vB if post_B is None else l_vB * post_B[None]
        l_vB = jnp.pad(l_vB, ((0, -l_vB.shape[0] % chunk), (0, 0)), constant_values=-jnp.inf)
        m, e = _block_stats(l_vB, chunk)
        maxima, sums = [*maxima, m], [*sums, e]
    block_top = jnp.stack([jnp.max(m, axis=0) for m in maxima])  # [blocks, B]
    top_B = jnp.max(block_top, axis=0)
    block_scale = jnp.exp(block_top - top_B[None])
    w_BJ = jnp.concatenate([e * block_scale[j][None] for j, e in enumerate(sums)]).T
    return jnp.concatenate(maxima).T, w_BJ, top_B


def sample_unembedded(hidden_BD: jax.Array, unembed_VD: jax.Array, s: SlotSampling, keys_B: jax.Array, *,
                      blocks: tuple[jax.Array, ...] | None = None, chunk: int = CHUNK
                      ) -> tuple[jax.Array, jax.Array]:
    """`sample(hidden_BD @ unembed_VD.T, s, keys_B, truncate=False)` without the [B, V] logits: the same
    distribution (temperature only: no truncation, penalty or ban) and the same uniform per row, so the
    same tokens up to float rounding near a chunk or token boundary. Returns (tokens int32 [B], logprobs
    float32 [B]).

    The unembedding runs over vocabulary blocks (`vocab_blocks`), each block's logits [v, B] staying in
    cache: per chunk of `chunk` tokens the max and the sum of exp(l - block max), as in the online softmax
    (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867): rescaled
    by exp(block max - row max) afterwards they give the chunk weights and the log normaliser `lse` over
    the whole vocabulary. The draw is `draw`'s inverse CDF (`pick_chunk`, `pick_within`): the chunk from
    the chunk weights, then, within it, from that chunk's logits, recomputed ([C, D] x [D] per row,
    cheaper than writing and reading back the [B, V] logits); its logprob is l_token / T - lse. A row
    whose recomputed chunk underflows to zero everywhere (weights below the float32 range) takes the
    chunk's largest logit. Greedy rows (T = 0) take the first chunk whose max is the row's max and, in
    it, the first maximum of the recomputed logits (the first maximum of the logits, up to rounding
    between the two products), reported with T = 1. Vocabulary padding (rows past V) is at -inf and never
    drawn.

    Args:
        hidden_BD: final hidden states, any float dtype (the product is cast to float32, as `decoder.logits`).
        unembed_VD: the unembedding as [V, D] rows: a tied embedding as it is, or an `OutMajor`'s `w_OI`
            (the rows as the dot's left operand: XLA's CPU dot's fast orientation at a few rows).
        keys_B: one PRNG key per row.
        blocks: `unembed_VD`'s rows in blocks, every one but the last a multiple of `chunk` rows
            (`vocab_blocks`, made once outside jit); None: `vocab_blocks(unembed_VD)` here, slices copied
            at every call.

    Raises:
        ValueError: a block other than the last is not a multiple of `chunk` rows.
    """
    v = unembed_VD.shape[0]
    if v < chunk:  # a toy vocabulary: one chunk
        chunk = v
    blocks = vocab_blocks(unembed_VD) if blocks is None else blocks
    if any(b.shape[0] % chunk for b in blocks[:-1]):
        raise ValueError(f"vocabulary blocks of {[b.shape[0] for b in blocks]} rows: not all whole chunks of {chunk}")
    greedy_B = s.temperature <= 0.0
    inv_t_B = 1.0 / jnp.where(greedy_B, 1.0, s.temperature).astype(jnp.float32)
    h_BD, post_B = _scaled(hidden_BD, inv_t_B)
    m_BJ, w_BJ, top_B = _blocks_stats(h_BD, blocks, post_B, chunk)
    u_B = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)  # (0, 1], as `sample`
    drawn_B, rest_B, total_B = pick_chunk(w_BJ, u_B)
    c_B = jnp.where(greedy_B, jnp.argmax(m_BJ, axis=-1), drawn_B)
    start_B = jnp.minimum(c_B * chunk, v - chunk)  # the last chunk may be short: its window ends at V
    rows_BCD = jax.vmap(lambda i: jax.lax.dynamic_slice_in_dim(unembed_VD, i, chunk))(start_B)
    l_BC = jnp.einsum("BD,BCD->BC", h_BD, rows_BCD).astype(jnp.float32)
    l_BC = l_BC if post_B is None else l_BC * post_B[:, None]
    l_BC = jnp.where(start_B[:, None] + jnp.arange(chunk)[None] >= c_B[:, None] * chunk, l_BC, -jnp.inf)
    w_BC = jnp.exp(l_BC - top_B[:, None])
    i_B = pick_within(w_BC, rest_B)
    i_B = jnp.where(jnp.any(w_BC > 0, axis=-1) & ~greedy_B, i_B, jnp.argmax(l_BC, axis=-1))
    # log p = (l - max) - log(sum exp(l - max)): l - max <= 0 and the sum >= exp(0) = 1 hold exactly, but the
    # token's logit is a second product (rounded apart from the blocks' max by an ulp of l / T: +0.3 at T 1e-4)
    # and the weights' exp may fuse with the scaling, so both bounds are applied: a logprob is never above 0.
    rel_B = jnp.minimum(jnp.take_along_axis(l_BC, i_B[:, None], axis=-1)[:, 0] - top_B, 0.0)
    return (start_B + i_B).astype(jnp.int32), rel_B - jnp.maximum(jnp.log(total_B), 0.0)
