"""The decoder of every model family as Flax NNX modules: the one declaration of every weight and LoRA factor.

Each weight is an `nnx.Param` created once, in the `__init__` of the module that holds it, by `_weight`:
its value (ones for the norms, zeros for LoRA's `b`, else normal std 0.02 as HF's `initializer_range`,
drawn by `_draw` once the module holds all its variables), and as metadata its shape
letters (`letters`, the letter table of `jaxrl.model.decoder`), its logical axes (`out_sharding`, which
`nnx.get_partition_spec` reads) and its initialiser (`init`). Everything else is derived from that:
  * `init_params` / `init_lora`: the values of a module built with a random key (the same values a seed
    gave before the modules existed: one key per weight, split in path order);
  * `param_specs` / `lora_specs`: a `jaxrl.parallel.spec.ParamSpec` per variable, read from the metadata of
    the module's abstract state (`nnx.eval_shape`, no arrays made); from them `jaxrl.parallel.sharding`
    derives the NamedShardings (its rules table maps the logical axes to mesh axes), `jaxrl.model.hf`
    the HF names and layouts, and the compile report and checkpoints their byte counts and restore targets;
  * what trains: LoRA factors are `LoRAParam`, their own variable type, and `trained_filter` says which
    variables a run trains (`LoRAParam`, or every `nnx.Param` in full fine-tuning); the optimizer's mask
    and the differentiated state are `nnx.split` by that filter (`jaxrl.rl.train`).

Design decisions:
  * The state keeps the nested-dict layout that checkpoints, HF load/save and the engine already use:
    `Model.base` is `Weights` (`embed`, `layers` [L, ...], `mlp` [Q, ...], `moe` [U, ...], `final_norm`,
    `unembed` when untied) and `Model.lora` is `LoRA` (group -> weight -> `a` / `b`); their pure dicts
    (`nnx.to_pure_dict`) are the `base` / `lora` pytrees that cross jit boundaries, are donated,
    checkpointed by Orbax and swapped into the engine in flight.
  * Layers stay stacked ([L, ...] arrays, not one module per layer) so `jax.lax.scan` runs them with a
    compile time flat in depth, and so an expert-parallel MoE block shards one [U, E, ...] array.
  * The forward math stays the pure functions of `jaxrl.model.decoder` (training, prefill) and
    `jaxrl.model.decode` (the decode step), which the methods of `Model` call with the module's arrays:
    the traced program, hence the logits and the speed, is the one those functions always produced.
  * A jitted step takes the pure dicts and rebuilds the module with `bind` (`nnx.merge` of a cached
    graphdef with the given states): no array is copied, so one set of base weights serves the trainer,
    the engine and the reference policy (`Model(..., lora=False)`: the same module with its LoRA off).

Letters as in `jaxrl.model.decoder`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.model import decode, decoder, moe, ragged
from jaxrl.model.blocks import LORA_TARGETS, Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.decoder import KVCache
from jaxrl.parallel.spec import ParamSpec


class LoRAParam(nnx.Param):
    """A LoRA factor (`a` [stack..., R, in...] or `b` [stack..., R, out...]): the variables a LoRA run trains."""


def lora_stack_axes(group: str) -> int:
    """Leading stack axes of a LoRA factor (and of the weight it adapts) in `group`: the layers, plus the
    experts in `moe`; the rank R is the axis after them in both `a` and `b`."""
    return 2 if group == "moe" else 1


def trained_filter(full: bool) -> type[nnx.Param]:
    """The nnx filter of the variables a run trains: every `nnx.Param` in full fine-tuning, else the
    `LoRAParam`s only (the base is frozen)."""
    return nnx.Param if full else LoRAParam


def _weight(kind: type[nnx.Param], dims: Mapping[str, int], dtype: Any, letters: str,
            axes: tuple[str | None, ...], init: str = "normal", drawn: str | None = None) -> nnx.Param:
    """One declared variable of `kind` with shape `letters` (sizes from `dims`), logical `axes` and `init`
    ("normal": std 0.02, drawn by `_draw` once the module has all its variables; "ones"; "zeros"), in
    `dtype`. `drawn`: the letters, a permutation of `letters`, in which `_draw` draws the normal values
    before transposing them to `letters` (None: `letters`), so a layout change keeps a seed's values.
    Placement is left to the caller (`eager_sharding=False`): the logical axes map to mesh axes
    through `jaxrl.parallel.sharding`."""
    shape = tuple(dims[c] for c in letters)
    value = jnp.ones(shape, dtype) if init == "ones" else jnp.zeros(shape, dtype)
    return kind(value, out_sharding=axes, letters=letters, init=init, drawn=drawn or letters, eager_sharding=False)


def _draw(module: nnx.Module, key: jax.Array) -> None:
    """Give every variable of `module` declared with init "normal" its random value: normal std 0.02 (as
    HF's `initializer_range`), drawn in float32 and cast to the variable's dtype, with one key per
    variable from `key` split over all of them in path order (`jax.tree.flatten`'s order of the pure dict),
    so a seed gives the same weights as jaxrl's earlier pytree initialiser. A variable declared with other
    `drawn` letters is drawn in that layout and transposed to its own (the LoRA `a` factors: drawn
    [stack..., in..., R], their layout before 2026-11-26, stored [stack..., R, in...])."""
    flat = list(nnx.to_flat_state(nnx.state(module)))
    for (_, var), k in zip(flat, jax.random.split(key, len(flat)), strict=True):
        if var.init == "normal":
            letters, drawn = var.letters, var.drawn
            shape = tuple(var.shape[letters.index(c)] for c in drawn)
            value = jnp.transpose(0.02 * jax.random.normal(k, shape, jnp.float32), [drawn.index(c) for c in letters])
            var.set_value(value.astype(var.dtype))


class Layers(nnx.Module):
    """Attention and norms of every layer, stacked [L, ...]: RMSNorm weights, the q/k/v/o projections
    ([in..., out...] with heads split out), the q/k/v biases where `cfg.attention_bias` (GLM-4.5) and the
    per-head query and key norms where `cfg.use_qk_norm` (Qwen3 always)."""

    def __init__(self, cfg: ModelConfig, dims: Mapping[str, int], dtype: Any):
        w = functools.partial(_weight, nnx.Param, dims, dtype)
        self.attn_norm = w("LD", ("layers", "embed"), "ones")
        self.wq = w("LDNH", ("layers", "embed", "heads", "head_dim"))
        self.wk = w("LDKH", ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = w("LDKH", ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = w("LNHD", ("layers", "heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.bq = w("LNH", ("layers", "heads", "head_dim"), "zeros")
            self.bk = w("LKH", ("layers", "kv_heads", "head_dim"), "zeros")
            self.bv = w("LKH", ("layers", "kv_heads", "head_dim"), "zeros")
        if cfg.use_qk_norm:
            self.q_norm = w("LH", ("layers", "head_dim"), "ones")
            self.k_norm = w("LH", ("layers", "head_dim"), "ones")
        self.mlp_norm = w("LD", ("layers", "embed"), "ones")


class MLP(nnx.Module):
    """The dense SwiGLU MLPs of the Q layers without an MoE block, stacked [Q, ...]."""

    def __init__(self, dims: Mapping[str, int], dtype: Any):
        w = functools.partial(_weight, nnx.Param, dims, dtype)
        self.w_gate = w("QDF", ("layers", "embed", "mlp"))
        self.w_up = w("QDF", ("layers", "embed", "mlp"))
        self.w_down = w("QFD", ("layers", "mlp", "embed"))


class MoE(nnx.Module):
    """The router and SwiGLU experts of the U layers with an MoE block, stacked [U, ...]; the experts'
    axes are `jaxrl.model.moe.EXPERT_AXES` (what its expert-parallel block shards). GLM-4.5 adds the
    router's `e_bias` (its `e_score_correction_bias`, zeros at init as transformers'; it only chooses
    experts, so no gradient reaches it) and the shared expert's `shared_gate` / `shared_up` /
    `shared_down` (width I, on every token; `cfg.n_shared_experts`)."""

    def __init__(self, cfg: ModelConfig, dims: Mapping[str, int], dtype: Any):
        w = functools.partial(_weight, nnx.Param, dims, dtype)
        self.router = w("UDE", ("layers", "embed", None))
        if cfg.sigmoid_router:
            self.e_bias = w("UE", ("layers", None), "zeros")
        self.w_gate = w("UEDI", ("layers", *moe.EXPERT_AXES["w_gate"]))
        self.w_up = w("UEDI", ("layers", *moe.EXPERT_AXES["w_up"]))
        self.w_down = w("UEID", ("layers", *moe.EXPERT_AXES["w_down"]))
        if cfg.n_shared_experts:
            self.shared_gate = w("UDI", ("layers", "embed", "mlp"))
            self.shared_up = w("UDI", ("layers", "embed", "mlp"))
            self.shared_down = w("UID", ("layers", "mlp", "embed"))


class Weights(nnx.Module):
    """Every base weight of a model (`mlp` / `moe` None when no layer is of that kind, `unembed` None
    when the embedding is tied)."""

    def __init__(self, cfg: ModelConfig, *, key: jax.Array, dtype: Any = jnp.float32):
        dims = cfg.dims()
        self.embed = _weight(nnx.Param, dims, dtype, "VD", ("vocab", "embed"))
        self.layers = Layers(cfg, dims, dtype)
        self.final_norm = _weight(nnx.Param, dims, dtype, "D", ("embed",), "ones")
        self.mlp = MLP(dims, dtype) if cfg.mlp_layers else None
        self.moe = MoE(cfg, dims, dtype) if cfg.moe_layers else None
        tied = cfg.tie_word_embeddings
        self.unembed = None if tied else _weight(nnx.Param, dims, dtype, "DV", ("embed", "vocab"))
        _draw(self, key)


class LoRA(nnx.Module):
    """LoRA factors (Hu et al. 2021) for `targets` (HF projection names, `blocks.LORA_TARGETS`) at `rank`,
    in the groups (`layers`, `mlp`, `moe`) that hold the adapted weight; `gate_proj` / `up_proj` /
    `down_proj` adapt both the dense MLPs and the experts (one adapter per expert).

    For a target with stack letters `pre` (`L`, `Q`, or `U` plus `E`), input letters `x` and output letters
    `y`, `a` is [pre, R, x] (normal) and `b` is [pre, R, y] (zeros, so a fresh adapter leaves the model
    unchanged, sec. 4.1); the axes of `a` / `b` are the base weight's, so they shard alike. `a` is
    rank-major, PEFT's own `lora_A.weight` [r, in]: its large input axes are the minor ones, so a TPU tiles
    it (and its gradient and Adam moments) without padding, where [pre, x, R] put the rank (16) on the
    128-lane minor axis, 8x padded (docs/tpu.md section 7.3). Its normal values are drawn [pre, x, R] and
    transposed (`_weight`'s `drawn`), so a seed gives the adapter it gave before the layout changed.
    """

    def __init__(self, cfg: ModelConfig, rank: int, targets: tuple[str, ...], *, key: jax.Array,
                 dtype: Any = jnp.float32):
        dims = {**cfg.dims(), "R": rank}
        base = param_specs(cfg)
        groups: dict[str, dict[str, nnx.Dict]] = {}
        for t in targets:
            name, n_in = LORA_TARGETS[t]
            for group in ("layers", "mlp", "moe"):
                spec = base.get(group, {}).get(name)
                if spec is None:
                    continue
                p = lora_stack_axes(group)
                pre, x, y = spec.letters[:p], spec.letters[p:p + n_in], spec.letters[p + n_in:]
                ax_pre, ax_x, ax_y = spec.axes[:p], spec.axes[p:p + n_in], spec.axes[p + n_in:]
                w = functools.partial(_weight, LoRAParam, dims, dtype)
                groups.setdefault(group, {})[name] = nnx.Dict(
                    a=w(pre + "R" + x, (*ax_pre, None, *ax_x), "normal", drawn=pre + x + "R"),
                    b=w(pre + "R" + y, (*ax_pre, None, *ax_y), "zeros"))
        for group in ("layers", "mlp", "moe"):
            setattr(self, group, nnx.Dict(groups[group]) if group in groups else None)
        _draw(self, key)


class Model(nnx.Module):
    """A model of any family: `base` weights, optional `lora` factors scaled by `lora_scale` (alpha / rank).

    Methods run the pure functions of `jaxrl.model.decoder` / `jaxrl.model.decode` over this module's arrays.
    """

    def __init__(self, cfg: ModelConfig, *, key: jax.Array, dtype: Any = jnp.float32, lora_rank: int = 0,
                 lora_targets: tuple[str, ...] = (), lora_scale: float = 0.0):
        self.cfg = cfg
        self.lora_scale = lora_scale
        self.base = Weights(cfg, key=key, dtype=dtype)
        self.lora = (LoRA(cfg, lora_rank, lora_targets, key=jax.random.fold_in(key, 1), dtype=dtype)
                     if lora_targets else None)

    def weights(self) -> tuple[Params, Params | None]:
        """The base and LoRA pytrees (`nnx.to_pure_dict`): this module's arrays, not copies."""
        lora = None if self.lora is None else nnx.to_pure_dict(nnx.state(self.lora))
        return nnx.to_pure_dict(nnx.state(self.base)), lora

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array, *, lora: bool = True,
                 cache: KVCache | None = None, remat: bool = False, mesh: Mesh | None = None,
                 scan_layers: bool = True, segment_ids: jax.Array | None = None,
                 layers: list[tuple] | None = None,
                 attention_impl: str | None = None) -> tuple[jax.Array, KVCache]:
        """Final-norm hidden states [B, T, D] and the KV cache: `decoder.forward` (arguments as there);
        `lora=False` runs the base alone (the reference policy, from the same arrays)."""
        base, factors = self.weights()
        return decoder.forward(self.cfg, base, tokens_BT, positions_BT, lora=factors if lora else None,
                               lora_scale=self.lora_scale, cache=cache, remat=remat, mesh=mesh,
                               scan_layers=scan_layers, segment_ids=segment_ids, layers=layers,
                               attention_impl=attention_impl)

    def decode(self, tokens_B: jax.Array, positions_B: jax.Array, cache: KVCache, *, mesh: Mesh | None = None,
               layers: list[tuple] | None = None,
               layout: decode.CacheLayout) -> tuple[jax.Array, KVCache]:
        """One decode step for every row: `jaxrl.model.decode.decode_step` (arguments as there)."""
        base, factors = self.weights()
        return decode.decode_step(self.cfg, base, tokens_B, positions_B, cache, lora=factors,
                                  lora_scale=self.lora_scale, mesh=mesh, layers=layers, layout=layout)

    def ragged(self, tokens_M: jax.Array, positions_M: jax.Array, cache: KVCache, attend: ragged.Attend, *,
               mesh: Mesh | None = None, layers: list[tuple] | None = None) -> tuple[jax.Array, KVCache]:
        """One ragged step over a flat batch of tokens: `jaxrl.model.ragged.ragged_step` (arguments as there)."""
        base, factors = self.weights()
        return ragged.ragged_step(self.cfg, base, tokens_M, positions_M, cache, attend, lora=factors,
                                  lora_scale=self.lora_scale, mesh=mesh, layers=layers)

    def unembed_matrix(self) -> jax.Array:
        """The output projection [D, V] (`decoder.unembed_matrix`)."""
        return decoder.unembed_matrix(self.weights()[0])


def _variable_specs(state: Any) -> dict[str, Any]:
    """A nested dict of `ParamSpec` read from the metadata of an (abstract) nnx state's variables."""
    if isinstance(state, nnx.Variable):
        return ParamSpec(state.letters, tuple(state.out_sharding), state.init)  # type: ignore[return-value]
    return {k: _variable_specs(v) for k, v in state.items()}


@functools.cache
def _abstract_weights(cfg: ModelConfig) -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: Weights(cfg, key=jax.random.key(0))))


@functools.cache
def _abstract_lora(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: LoRA(cfg, rank, targets, key=jax.random.key(0))))


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    """Every base weight's `ParamSpec` (letters, logical axes, initialiser), with the params' structure,
    read from the `Weights` declaration (no arrays are made)."""
    return _variable_specs(_abstract_weights(cfg))


def lora_specs(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> dict[str, Any]:
    """Every LoRA factor's `ParamSpec`, with the LoRA's structure, read from the `LoRA` declaration."""
    return _variable_specs(_abstract_lora(cfg, rank, tuple(targets)))


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random base weights (the pure dict of a fresh `Weights`), the structure of `param_specs(cfg)`."""
    return nnx.to_pure_dict(nnx.state(Weights(cfg, key=key, dtype=dtype)))


def init_lora(cfg: ModelConfig, rank: int, targets: tuple[str, ...], key: jax.Array,
              dtype: Any = jnp.float32) -> Params:
    """Fresh LoRA factors (`b` = 0) for `targets` at `rank`, the structure of `lora_specs`."""
    return nnx.to_pure_dict(nnx.state(LoRA(cfg, rank, tuple(targets), key=key, dtype=dtype)))


def lora_signature(lora: Params | None) -> tuple[int, tuple[str, ...]]:
    """(rank, targets) of a LoRA pytree with the structure of `lora_specs`; (0, ()) for none (None or {})."""
    if not lora:
        return 0, ()
    names = {name for group in lora.values() for name in group}
    rank = next(ab["a"].shape[lora_stack_axes(g)] for g, group in lora.items() for ab in group.values())
    return rank, tuple(t for t, (name, _) in LORA_TARGETS.items() if name in names)


def variables(params: Params) -> Params:
    """A `{"base", "lora"}` pytree (`Model.weights`) with each array as the variable of the `Model` it
    belongs to: base leaves as `nnx.Param`, LoRA leaves as `LoRAParam`, as `Weights` and `LoRA` declare
    them, so that an nnx filter (`trained_filter`) selects among them (the optimizer's mask,
    `jaxrl.rl.train`). The same dicts (empty ones too), no copies."""
    return {"base": jax.tree.map(nnx.Param, params["base"]), "lora": jax.tree.map(LoRAParam, params["lora"])}


@functools.cache
def _graphdef(cfg: ModelConfig, rank: int, targets: tuple[str, ...], lora_scale: float) -> nnx.GraphDef:
    model = nnx.eval_shape(lambda: Model(cfg, key=jax.random.key(0), lora_rank=rank, lora_targets=targets,
                                         lora_scale=lora_scale))
    return nnx.graphdef(model)


def bind(cfg: ModelConfig, base: Params, lora: Params | None = None, lora_scale: float = 0.0) -> Model:
    """The `Model` module over existing weights: `nnx.merge` of its graphdef with the `base` and `lora`
    pytrees as states. No array is copied; under jit this costs nothing at run time.

    Raises:
        ValueError: (from nnx) the pytrees do not have the structure of `param_specs` / `lora_specs`.
    """
    rank, targets = lora_signature(lora)
    states = [nnx.State({"base": base})] + ([nnx.State({"lora": lora})] if targets else [])
    return nnx.merge(_graphdef(cfg, rank, targets, float(lora_scale)), *states)
