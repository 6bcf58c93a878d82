"""Qwen3-MoE's and GLM-4.5's sparse MLP block: top-k routing and two dispatch paths, both dropless.

Letters as in `jaxrl.model.decoder`, plus M tokens (B * T flattened), X the top-k slots of a token, and
A = M * X token-expert assignments.

Routing follows transformers' `Qwen3MoeTopKRouter`: probabilities `softmax(h @ router)` in fp32, the
`num_experts_per_tok` largest with their expert ids, renormalised to sum to 1 when `norm_topk_prob`;
or GLM-4.5's sigmoid router with its score-correction bias and grouped top-k (`route`).
The block's output is `sum_k p_k * expert_k(h)` with SwiGLU experts `down(silu(gate(h)) * up(h))`.

- `experts_dense` runs every expert on every token and weights the results (E / k times the useful
  FLOPs): simple and fast for the handful of experts of test models.
- `experts_grouped` sorts the assignments by expert and runs each expert on its own rows with
  `jax.lax.ragged_dot`: only the useful FLOPs, for real expert counts. `experts_chunked` runs it on
  chunks of tokens one after another, so that only one chunk's rows and activations are held at a time.
- `moe_block` with an `expert` mesh axis larger than 1 is expert parallel (`shard_map`): every device
  holds E / ep experts, and one of two dispatchers, chosen per mesh and shapes in one place
  (`choose_dispatch`), brings each token to its experts' devices and the outputs back:
  - all-gather (`Dispatch.ALL_GATHER`; Megatron-LM's all-gather dispatcher, MaxText's "ring of experts"):
    the tokens of the ep devices of an expert group are all-gathered, each device runs its experts on the
    rows routed to them (`experts_chunked`), and a reduce-scatter returns each token's summed output to
    the device that owns it. It moves every token to each of the ep devices rather than only to its k
    experts' devices.
  - ragged all-to-all (`Dispatch.ALL_TO_ALL`; MaxText's `sparse_matmul` with expert parallelism): each
    token-expert assignment goes as one row to its expert's device and its output comes back
    (`experts_all_to_all`, the collectives in `jaxrl.model.moe_all_to_all`).
  Neither has a capacity, so no token is ever dropped. Expert weights sharded over `fsdp`/`tensor` are
  gathered per layer inside the block (ZeRO-3 style).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl.model import kernels
from jaxrl.model import moe_all_to_all as a2a
from jaxrl.parallel.sharding import RULES, logical_spec

# Logical axes of each expert weight ([E, in, out], without the layer stack); declared here once and
# used by `jaxrl.model.modules.MoE` and by the expert-parallel block's shard_map specs.
EXPERT_AXES: dict[str, tuple[str | None, ...]] = {
    "w_gate": ("experts", "embed", "mlp"),
    "w_up": ("experts", "embed", "mlp"),
    "w_down": ("experts", "mlp", "embed"),
}
# `ragged_dot_general` of rows [A, in], grouped by expert, with a rank-major LoRA `a` [E, R, in]: the rows'
# axis 1 contracts the factor's axis 2, groups on the factor's axis 0 (ragged_dot's own numbers contract axis 1)
_RANK_MAJOR = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
DENSE_DISPATCH_MAX_EXPERTS = 8  # up to this many experts, one device runs `experts_dense`
ASSIGNMENTS_PER_CHUNK = 16384  # `experts_chunked`: at most about this many assignments' rows at a time


def route(h_MD: jax.Array, router_DE: jax.Array, top_k: int, norm_topk_prob: bool, *,
          e_bias_E: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Top-k routing. Returns expert ids [M, X] int32 and their weights [M, X] float32.

    Without `e_bias_E` (Qwen3-MoE, transformers' `Qwen3MoeTopKRouter`): scores `softmax(h @ router)` in
    fp32, the `top_k` largest, renormalised to sum to 1 when `norm_topk_prob`.

    With `e_bias_E` (float32 [E], GLM-4.5's `e_score_correction_bias`; transformers'
    `Glm4MoeTopkRouter.forward` in `models/glm4_moe/modeling_glm4_moe.py`): scores `sigmoid(h @ router)`
    in fp32; the experts are chosen by `scores + e_bias_E`, among the `topk_group` of `n_group` equal
    groups whose two best biased scores sum highest (every group when `n_group` is 1); the weights are the
    chosen experts' unbiased scores, divided by their sum (+ 1e-20) when `norm_topk_prob`, times
    `routed_scaling` (its `routed_scaling_factor`)."""
    logits_ME = jnp.einsum("MD,DE->ME", h_MD, router_DE).astype(jnp.float32)
    if e_bias_E is None:
        probs_ME = jax.nn.softmax(logits_ME, axis=-1)
        w_MX, idx_MX = jax.lax.top_k(probs_ME, top_k)
        if norm_topk_prob:
            w_MX = w_MX / jnp.sum(w_MX, axis=-1, keepdims=True)
        return idx_MX.astype(jnp.int32), w_MX * routed_scaling
    scores_ME = jax.nn.sigmoid(logits_ME)
    choice_ME = scores_ME + e_bias_E.astype(jnp.float32)[None]
    if n_group > 1:
        m, e = choice_ME.shape
        best2_MGx = jax.lax.top_k(choice_ME.reshape(m, n_group, e // n_group), 2)[0]
        _, groups_Mg = jax.lax.top_k(jnp.sum(best2_MGx, axis=-1), topk_group)
        keep_MG = jnp.any(jax.nn.one_hot(groups_Mg, n_group, dtype=jnp.bool_), axis=1)
        keep_ME = jnp.repeat(keep_MG, e // n_group, axis=1)
        choice_ME = jnp.where(keep_ME, choice_ME, -jnp.inf)
    _, idx_MX = jax.lax.top_k(choice_ME, top_k)
    w_MX = jnp.take_along_axis(scores_ME, idx_MX, axis=-1)
    if norm_topk_prob:
        w_MX = w_MX / (jnp.sum(w_MX, axis=-1, keepdims=True) + 1e-20)
    return idx_MX.astype(jnp.int32), w_MX * routed_scaling


def _expert_lora(x: jax.Array, ab: dict[str, jax.Array] | None, scale: float, lhs: str) -> jax.Array | float:
    """Per-expert LoRA delta [M, E, out] for input `x` with letters `lhs`: "MD" (one input for all
    experts) or "MEI" (each expert's own input)."""
    if ab is None:
        return 0.0
    xa_MER = jnp.einsum(f"{lhs},ER{lhs[-1]}->MER", x, ab["a"])
    return (scale * jnp.einsum("MER,ERO->MEO", xa_MER, ab["b"])).astype(x.dtype)


def experts_dense(h_MD: jax.Array, idx_MX: jax.Array, w_MX: jax.Array, we: dict[str, jax.Array],
                  lwe: dict[str, Any] | None, lora_scale: float) -> jax.Array:
    """Every expert on every token, combined with the routing weights. Returns [M, D] in h's dtype.

    `we`: w_gate/w_up [E, D, I], w_down [E, I, D]; `lwe`: optional LoRA factors per weight,
    `a` [E, R, in] (rank-major, `modules.LoRA`) and `b` [E, R, out].
    """
    lwe = lwe or {}
    e = we["w_gate"].shape[0]
    combine_ME = jnp.sum(jax.nn.one_hot(idx_MX, e, dtype=jnp.float32) * w_MX[..., None], axis=1)
    gate_MEI = jnp.einsum("MD,EDI->MEI", h_MD, we["w_gate"]) + _expert_lora(h_MD, lwe.get("w_gate"), lora_scale, "MD")
    up_MEI = jnp.einsum("MD,EDI->MEI", h_MD, we["w_up"]) + _expert_lora(h_MD, lwe.get("w_up"), lora_scale, "MD")
    act_MEI = jax.nn.silu(gate_MEI) * up_MEI
    out_MED = jnp.einsum("MEI,EID->MED", act_MEI, we["w_down"]) + _expert_lora(
        act_MEI, lwe.get("w_down"), lora_scale, "MEI")
    return jnp.einsum("MED,ME->MD", out_MED, combine_ME.astype(out_MED.dtype))


def _grouped_swiglu(rows_AD: jax.Array, sizes_E: jax.Array, we: dict[str, jax.Array], lwe: dict[str, Any],
                    lora_scale: float) -> jax.Array:
    """The SwiGLU experts on rows [A, D] grouped by expert, `sizes_E` int32 [E] rows each in order (rows
    past their sum get zeros), as grouped matmuls (`jax.lax.ragged_dot`). Returns [A, D]."""

    def matmul(v, name):
        y = jax.lax.ragged_dot(v, we[name], sizes_E)
        if (ab := lwe.get(name)) is not None:
            va = jax.lax.ragged_dot_general(v, ab["a"], sizes_E, _RANK_MAJOR)  # [A, in] by [E, R, in]
            y = y + (lora_scale * jax.lax.ragged_dot(va, ab["b"], sizes_E)).astype(y.dtype)
        return y

    act_AI = jax.nn.silu(matmul(rows_AD, "w_gate")) * matmul(rows_AD, "w_up")
    return matmul(act_AI, "w_down")


def experts_grouped(h_MD: jax.Array, idx_MX: jax.Array, w_MX: jax.Array, we: dict[str, jax.Array],
                    lwe: dict[str, Any] | None, lora_scale: float, first_expert: jax.Array | int = 0) -> jax.Array:
    """The experts `first_expert ... first_expert + E_local - 1` (those in `we`) on the assignments
    routed to them, as grouped matmuls (`jax.lax.ragged_dot`). Assignments to other experts
    contribute nothing. Returns [M, D] in h's dtype; weights and LoRA as in `experts_dense`.
    """
    e_local = we["w_gate"].shape[0]
    m, x = idx_MX.shape
    local_A = idx_MX.reshape(m * x) - first_expert
    mine_A = (local_A >= 0) & (local_A < e_local)
    group_A = jnp.where(mine_A, local_A, e_local)  # other experts' rows sort last, past every group
    order_A = jnp.argsort(group_A, stable=True)
    token_A = order_A // x
    sizes_E = jnp.bincount(group_A, length=e_local + 1)[:e_local].astype(jnp.int32)
    out_AD = _grouped_swiglu(h_MD[token_A], sizes_E, we, lwe or {}, lora_scale)
    weight_A = jnp.where(mine_A, w_MX.reshape(m * x), 0.0)[order_A]
    return jnp.zeros_like(h_MD).at[token_A].add((out_AD * weight_A[:, None]).astype(h_MD.dtype))


def experts_all_to_all(h_MD: jax.Array, idx_MX: jax.Array, w_MX: jax.Array, we: dict[str, jax.Array],
                       lwe: dict[str, Any] | None, lora_scale: float, experts: int, emulate: bool) -> jax.Array:
    """One device's tokens through every expert of the `expert` mesh axis, inside `shard_map`: each of the M * X
    assignments goes as one row to the device holding its expert and its output comes back
    (`jaxrl.model.moe_all_to_all`); this device runs its E_local experts (those in `we`, of `experts` in all)
    on what it receives, which arrives grouped by expert (`_grouped_swiglu`). The receive buffer holds the
    most rows that can arrive without dropping any, ep * M * min(E_local, X) (every device's tokens all
    routed here). `emulate`: a CPU mesh (`moe_all_to_all.ragged_all_to_all`). Returns [M, D] in h's dtype;
    weights and LoRA as in `experts_dense`."""
    e_local = we["w_gate"].shape[0]
    m, x = idx_MX.shape
    ep = experts // e_local
    expert_A = idx_MX.reshape(m * x)
    order_A = jnp.argsort(expert_A, stable=True)
    token_A = order_A // x
    p = a2a.plan(jnp.bincount(expert_A, length=experts).astype(jnp.int32), e_local, "expert")
    buffer_rows = ep * m * min(e_local, x)
    got_RD = a2a.send(h_MD[token_A], p, buffer_rows, "expert", emulate)
    out_RD = _grouped_swiglu(got_RD, p.local_sizes, we, lwe or {}, lora_scale)
    out_AD = a2a.give_back(out_RD, p, m * x, "expert", emulate)
    weight_A = w_MX.reshape(m * x)[order_A]
    return jnp.zeros_like(h_MD).at[token_A].add((out_AD * weight_A[:, None]).astype(h_MD.dtype))


def chunk_count(tokens: int, top_k: int, assignments_per_chunk: int) -> int:
    """Chunks `experts_chunked` splits `tokens` tokens into: the fewest, a power of two dividing `tokens`,
    that leave at most `assignments_per_chunk` assignments (tokens x `top_k`) a chunk, or the most that
    divide it."""
    c = 1
    while tokens * top_k > c * assignments_per_chunk and tokens % (2 * c) == 0:
        c *= 2
    return c


def experts_chunked(h_MD: jax.Array, idx_MX: jax.Array, w_MX: jax.Array, we: dict[str, jax.Array],
                    lwe: dict[str, Any] | None, lora_scale: float, first_expert: jax.Array | int = 0,
                    assignments_per_chunk: int = ASSIGNMENTS_PER_CHUNK) -> jax.Array:
    """`experts_grouped` on contiguous chunks of the M tokens (`in_chunks`). Without chunks, the grouped
    dispatch holds every assignment's row, [M * X, D], and the experts' activations, [M * X, I], at once,
    forward and backward: under expert parallelism M is the whole expert group's tokens (for Qwen3-235B-A22B
    on 8 expert shards of one 4096-token sequence each, 262,144 rows of 4096, 2 GiB in bfloat16). With
    chunks, about `assignments_per_chunk` rows at a time (`chunk_count`). Returns [M, D] in h's dtype."""
    m, x = idx_MX.shape

    def run(h, idx, w):
        return experts_grouped(h, idx, w, we, lwe, lora_scale, first_expert)

    return in_chunks(run, chunk_count(m, x, assignments_per_chunk), h_MD, idx_MX, w_MX)


def in_chunks(run: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], chunks: int, h_MD: jax.Array,
              idx_MX: jax.Array, w_MX: jax.Array) -> jax.Array:
    """`run(h, idx, w)` on `chunks` contiguous chunks of the M tokens, one chunk after another (`jax.lax.map`),
    each chunk's scratch recomputed in the backward pass (`jax.checkpoint`) rather than kept, so that only one
    chunk's rows and activations are held at a time. The same values as one call: a token's output depends on
    its own assignments only. Returns [M, D]."""
    if chunks == 1:
        return run(h_MD, idx_MX, w_MX)
    m, x = idx_MX.shape

    @jax.checkpoint
    def chunk(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        return run(*args)

    split = (h_MD.reshape(chunks, m // chunks, -1), idx_MX.reshape(chunks, m // chunks, x),
             w_MX.reshape(chunks, m // chunks, x))
    return jax.lax.map(chunk, split).reshape(h_MD.shape)


def _gather_non_expert(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """All-gather every sharded dimension of a local block except its `expert` sharding."""
    for dim, axes in enumerate(spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        others = tuple(a for a in axes if a != "expert")
        if others:
            x = jax.lax.all_gather(x, others, axis=dim, tiled=True)
    return x


class Dispatch(enum.Enum):
    """How an expert-parallel block moves tokens to the devices of their experts (`moe_block`)."""

    ALL_GATHER = "all-gather"  # every token to each device of its expert group, outputs reduce-scattered back
    ALL_TO_ALL = "all-to-all"  # each token-expert assignment to its expert's device and back (ragged)


def choose_dispatch(mesh: Mesh, top_k: int, tokens_split: bool) -> Dispatch:
    """The dispatcher an expert-parallel block runs on `mesh` (its `expert` axis of ep devices): the one place
    it is chosen.

    Each way a token's hidden state crosses the expert axis and its output comes back. The all-gather sends
    a token to the ep - 1 other devices of its group, whatever its experts; the ragged all-to-all sends one
    row per assignment, X = `top_k` of them, (ep - 1) / ep of them to another device under balanced routing.
    So the all-to-all moves X / ep of the all-gather's bytes and is chosen when `top_k` < ep, where XLA
    compiles it (`kernels.ragged_all_to_all`). Compiled for Qwen3-30B-A3B's block (top-8) on v5p-8 and
    v5p-16 (ep 4) the two count the same FLOPs and about the same bytes accessed, the all-to-all holds
    30% fewer temporaries and its exchange twice the bytes: the all-gather stays. Tokens not split over the
    expert axis (`tokens_split` False: every device already holds the group's tokens) need no exchange: the
    all-gather block then only sums the outputs (`psum`). Figures: docs/tpu.md, 7.4."""
    ep = mesh.shape["expert"]
    if tokens_split and top_k < ep and kernels.ragged_all_to_all(mesh) is not kernels.Ragged.REFUSED:
        return Dispatch.ALL_TO_ALL
    return Dispatch.ALL_GATHER


def moe_block(h_BTD: jax.Array, router_DE: jax.Array, we: dict[str, jax.Array], lwe: dict[str, Any] | None,
              *, top_k: int, norm_topk_prob: bool, lora_scale: float, mesh: Mesh | None = None,
              dispatch: str = "auto", assignments_per_chunk: int = ASSIGNMENTS_PER_CHUNK,
              e_bias_E: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
              routed_scaling: float = 1.0, expert_dispatch: Dispatch | None = None) -> jax.Array:
    """The sparse MLP block on [B, T, D] hidden states; returns [B, T, D] in their dtype.

    Args:
        router_DE: the router weight (HF `mlp.gate`).
        top_k, norm_topk_prob, e_bias_E, n_group, topk_group, routed_scaling: the routing (`route`;
            `e_bias_E` given: GLM-4.5's sigmoid router).
        we, lwe: expert weights and optional LoRA factors (see `experts_dense`).
        mesh: the device mesh; with an `expert` axis of size > 1 the block is expert parallel.
        dispatch: on one expert shard, "dense", "grouped", or "auto" (dense up to
            `DENSE_DISPATCH_MAX_EXPERTS` experts).
        assignments_per_chunk: the grouped dispatch runs in chunks of about this many token-expert
            assignments (`experts_chunked`), the all-to-all in chunks whose receive buffer has about this
            many rows.
        expert_dispatch: on an expert mesh, how tokens reach their experts' devices; None (what the model
            passes): `choose_dispatch`. Given only by tests that hold the two dispatchers to the same numbers.

    Raises:
        ValueError: the expert count is not a multiple of the `expert` mesh axis; `Dispatch.ALL_TO_ALL`
            with tokens that are not split over the `expert` axis.
    """
    b, t, d = h_BTD.shape
    idx_MX, w_MX = route(h_BTD.reshape(b * t, d), router_DE, top_k, norm_topk_prob, e_bias_E=e_bias_E,
                         n_group=n_group, topk_group=topk_group, routed_scaling=routed_scaling)
    e = we["w_gate"].shape[0]
    ep = 1 if mesh is None else mesh.shape["expert"]
    if ep == 1:
        dense = dispatch == "dense" or (dispatch == "auto" and e <= DENSE_DISPATCH_MAX_EXPERTS)
        if dense:
            return experts_dense(h_BTD.reshape(b * t, d), idx_MX, w_MX, we, lwe, lora_scale).reshape(b, t, d)
        return experts_chunked(h_BTD.reshape(b * t, d), idx_MX, w_MX, we, lwe, lora_scale,
                               assignments_per_chunk=assignments_per_chunk).reshape(b, t, d)
    if e % ep:
        raise ValueError(f"{e} experts cannot be split over an expert mesh axis of size {ep}")

    return _expert_parallel(h_BTD.reshape(b * t, d), idx_MX, w_MX, we, lwe or {}, lora_scale, mesh,
                            assignments_per_chunk, expert_dispatch).reshape(b, t, d)


def _expert_parallel(h_MD: jax.Array, idx_MX: jax.Array, w_MX: jax.Array, we: dict[str, jax.Array],
                     lwe: dict[str, Any], lora_scale: float, mesh: Mesh, assignments_per_chunk: int,
                     dispatch: Dispatch | None) -> jax.Array:
    """`moe_block` on a mesh whose `expert` axis is larger than 1: the tokens [M, D] of the whole batch and
    their routing through the experts, inside `shard_map` (`dispatch`, None: `choose_dispatch`). Returns
    [M, D] placed as `h_MD`."""
    e, (m, d), x = we["w_gate"].shape[0], h_MD.shape, idx_MX.shape[1]
    ep = mesh.shape["expert"]
    tok_spec = logical_spec(("batch", None), (m, d), mesh, RULES)
    route_spec = PartitionSpec(tok_spec[0], None)
    split = "expert" in ((tok_spec[0],) if isinstance(tok_spec[0], str) else tuple(tok_spec[0] or ()))
    dispatch = dispatch or choose_dispatch(mesh, x, split)
    if dispatch is Dispatch.ALL_TO_ALL and not split:
        raise ValueError(f"the all-to-all dispatch needs the {m} tokens split over the expert axis ({ep})")
    emulate = kernels.ragged_all_to_all(mesh) is kernels.Ragged.EMULATED
    w_specs = {k: logical_spec(EXPERT_AXES[k], v.shape, mesh, RULES) for k, v in we.items()}
    lw_specs = {k: {"a": logical_spec((EXPERT_AXES[k][0], None, EXPERT_AXES[k][1]), ab["a"].shape, mesh, RULES),
                    "b": logical_spec((EXPERT_AXES[k][0], None, EXPERT_AXES[k][2]), ab["b"].shape, mesh, RULES)}
                for k, ab in lwe.items()}

    def local(h_MD, idx_MX, w_MX, we, lwe):
        we = {k: _gather_non_expert(v, w_specs[k]) for k, v in we.items()}
        lwe = {k: {f: _gather_non_expert(v, lw_specs[k][f]) for f, v in ab.items()} for k, ab in lwe.items()}
        if dispatch is Dispatch.ALL_TO_ALL:
            def run(h, idx, w):
                return experts_all_to_all(h, idx, w, we, lwe, lora_scale, e, emulate)

            rows_per_token = ep * min(e // ep, x)  # the receive buffer's rows per local token
            return in_chunks(run, chunk_count(h_MD.shape[0], rows_per_token, assignments_per_chunk),
                             h_MD, idx_MX, w_MX)
        if split:  # bring the expert group's tokens together
            h_MD, idx_MX, w_MX = (jax.lax.all_gather(v, "expert", axis=0, tiled=True) for v in (h_MD, idx_MX, w_MX))
        first = jax.lax.axis_index("expert") * we["w_gate"].shape[0]
        out_MD = experts_chunked(h_MD, idx_MX, w_MX, we, lwe, lora_scale, first, assignments_per_chunk)
        if split:  # sum over the experts and hand each token back to its owner
            return jax.lax.psum_scatter(out_MD, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(out_MD, "expert")

    return jax.shard_map(local, mesh=mesh, in_specs=(tok_spec, route_spec, route_spec, w_specs, lw_specs),
                         out_specs=tok_spec, check_vma=False)(h_MD, idx_MX, w_MX, we, lwe)
