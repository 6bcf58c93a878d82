"""A LoRA in Hugging Face's formats: folded into the base weights (a merged checkpoint that
`Qwen3ForCausalLM.from_pretrained` loads), or a PEFT adapter folder that `peft.PeftModel.from_pretrained`
loads onto the base model, and such a folder read back into a jaxrl LoRA.

PEFT's adapter format (peft 0.21): `adapter_config.json` (a `LoraConfig`) and `adapter_model.safetensors`
with, for every adapted Linear `<module>` of the HF model, `base_model.model.<module>.lora_A.weight`
[R, in] and `lora_B.weight` [out, R]; the update is `(lora_alpha / r) * B @ A`, which is jaxrl's
`lora_scale * a.T @ b` with `A = a` (jaxrl's `a` is rank-major too: [R, in...]), `B = b.T` (heads flattened
as HF flattens them). MoE experts are
written per expert (`mlp.experts.{e}.gate_proj`), the layout vLLM and transformers 4 use; peft fuses
them into transformers 5's stacked `gate_up_proj` / `down_proj` parameters when it loads the adapter,
which needs `gate_proj` and `up_proj` targeted together and no dense-MLP layers beside the experts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from etils import epath

from jaxrl.model import hf
from jaxrl.model.blocks import LORA_TARGETS, Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.modules import lora_specs, lora_stack_axes, param_specs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_N_IN = {name: n_in for name, n_in in LORA_TARGETS.values()}  # our weight name -> its input axes
_EXPERT_TARGETS = ("gate_proj", "up_proj")  # fused into one `gate_up_proj` by transformers 5


def _merged(w: jax.Array, a: jax.Array, b: jax.Array, scale: float | jax.Array, letters: str,
            n_stack: int, n_in: int) -> jax.Array:
    """`w + scale * a.T @ b` for one stacked weight with shape letters `letters` (`a` [stack..., R, in...],
    `b` [stack..., R, out...]), computed in fp32 at full matmul precision and returned in `w`'s dtype."""
    pre, x, y = letters[:n_stack], letters[n_stack:n_stack + n_in], letters[n_stack + n_in:]
    delta = jnp.einsum(f"{pre}R{x},{pre}R{y}->{letters}", a.astype(jnp.float32), b.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def _lora_weights(cfg: ModelConfig, params: Params, lora: Params) -> list[tuple[str, str, str]]:
    """(group, weight, shape letters) of every adapted weight. Raises ValueError for a LoRA weight the
    params do not have or whose factors do not fit it."""
    specs = param_specs(cfg)
    out = []
    for group, weights in lora.items():
        for name, ab in weights.items():
            if name not in specs.get(group, {}) or name not in _N_IN or name not in params.get(group, {}):
                raise ValueError(f"LoRA weight {group}/{name} adapts no weight of this model")
            letters, w = specs[group][name].letters, params[group][name]
            p, n_in = lora_stack_axes(group), _N_IN[name]
            rank = ab["a"].shape[p]
            want_a = (*w.shape[:p], rank, *w.shape[p:p + n_in])
            want_b = (*w.shape[:p], rank, *w.shape[p + n_in:])
            if tuple(ab["a"].shape) != want_a or tuple(ab["b"].shape) != want_b:
                raise ValueError(f"LoRA weight {group}/{name} has a {tuple(ab['a'].shape)}, b "
                                 f"{tuple(ab['b'].shape)}; the model's {tuple(w.shape)} needs {want_a}, {want_b}")
            out.append((group, name, letters))
    return out


def merge_lora(cfg: ModelConfig, params: Params, lora: Params, lora_scale: float | jax.Array) -> Params:
    """The base params with the LoRA folded in: `w + lora_scale * a @ b` for every adapted weight (every
    group: attention, dense MLPs, each MoE expert), so that `forward(cfg, merged, ...)` equals
    `forward(cfg, params, ..., lora=lora, lora_scale=lora_scale)` up to rounding. Pure and jit-able;
    the sum is taken in fp32 and stored in each weight's dtype.

    Args:
        params: the structure of `param_specs(cfg)`.
        lora: the structure of `lora_specs(cfg, rank, targets)` (`a` [stack..., R, in...],
            `b` [stack..., R, out...]).
        lora_scale: `lora_alpha / rank`.

    Returns:
        A params tree of the same structure; weights without LoRA are the same arrays.

    Raises:
        ValueError: a LoRA weight adapts no weight of `params`, or its shapes do not fit.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    for group, name, letters in _lora_weights(cfg, params, lora):
        ab = lora[group][name]
        out[group][name] = _merged(params[group][name], ab["a"], ab["b"], lora_scale, letters,
                                   lora_stack_axes(group), _N_IN[name])
    return out


_merged_jit = jax.jit(_merged, static_argnames=("letters", "n_stack", "n_in"))


def save_merged(folder: str | Path, cfg: ModelConfig, params: Params, lora: Params, lora_scale: float,
                dtype: Any | None = None) -> list[Path]:
    """Write the merged model (`merge_lora`) as a HF checkpoint (`hf.save_hf`). Weights are merged one
    at a time and copied to the host, so the device holds one merged weight beside the params.

    Args:
        dtype: dtype of the stored tensors; None keeps each weight's own.

    Returns:
        The weight files written.

    Raises:
        ValueError: as `merge_lora` and `hf.save_hf`.
    """
    merged: Params = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    for group, name, letters in _lora_weights(cfg, params, lora):
        ab = lora[group][name]
        w = _merged_jit(params[group][name], ab["a"], ab["b"], lora_scale, letters=letters,
                        n_stack=lora_stack_axes(group), n_in=_N_IN[name])
        merged[group][name] = np.asarray(w)
        del w
    return hf.save_hf(folder, cfg, merged, dtype=dtype)


def _adapted(cfg: ModelConfig, targets: tuple[str, ...]) -> list[tuple[str, str]]:
    """(group, weight) of every weight a LoRA on `targets` adapts, in `lora_specs` order."""
    return [(group, name) for group, weights in lora_specs(cfg, 1, targets).items() for name in weights]


def check_peft_targets(cfg: ModelConfig, targets: tuple[str, ...]) -> None:
    """Raise ValueError for unknown `targets`, or a LoRA on them that peft cannot load onto transformers 5's
    Qwen3-MoE or GLM-4.5 MoE (`save_adapter`): on a GLM-4.5, attention targets only."""
    unknown = sorted(set(targets) - LORA_TARGETS.keys())
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; expected some of {sorted(LORA_TARGETS)}")
    mlp = {"gate_proj", "up_proj", "down_proj"} & set(targets)
    if not cfg.is_moe or not mlp:
        return
    if len(set(_EXPERT_TARGETS) & mlp) == 1:
        raise ValueError("a PEFT adapter cannot hold expert LoRA on only one of gate_proj and up_proj: "
                         "transformers 5 fuses each expert's two into one gate_up_proj and peft converts "
                         "the adapter only when both are targeted; export the merged model instead")
    if cfg.mlp_layers:
        raise ValueError(f"a PEFT adapter cannot hold MLP LoRA for an MoE model with dense-MLP layers "
                         f"{list(cfg.mlp_layers)}: peft maps gate_proj/up_proj/down_proj to the experts "
                         "only when it loads the adapter; export the merged model instead")
    if cfg.n_shared_experts:
        raise ValueError("a PEFT adapter cannot hold MLP LoRA for a GLM-4.5 MoE: peft would also adapt its "
                         "shared experts' gate_proj/up_proj/down_proj, which jaxrl's LoRA leaves alone; "
                         "export the merged model instead")


def save_adapter(folder: str | epath.PathLike, cfg: ModelConfig, lora: Params, *, rank: int, alpha: float,
                 targets: tuple[str, ...] | list[str], base_model_name_or_path: str) -> epath.Path:
    """Write `lora` as a PEFT LoRA adapter folder: `adapter_model.safetensors` (fp32 `lora_A` [R, in] and
    `lora_B` [out, R] per adapted module, see the module docstring) and `adapter_config.json`, written
    last. `folder` may be local or `gs://`.

    Args:
        lora: the structure of `lora_specs(cfg, rank, targets)`.
        rank, alpha: the LoRA rank and alpha (PEFT's `r`, `lora_alpha`; the scale is alpha / rank).
        targets: HF projection names (`q_proj`, ...), PEFT's `target_modules`.
        base_model_name_or_path: recorded in the config (a hub id or a local folder).

    Returns:
        The folder.

    Raises:
        ValueError: `lora` does not have the structure `targets` and `rank` imply, or (Qwen3-MoE) the
            experts are adapted in a way peft cannot load (`gate_proj` without `up_proj` or the
            reverse, or dense-MLP layers beside MoE layers).
    """
    targets = tuple(targets)
    check_peft_targets(cfg, targets)
    adapted = _adapted(cfg, targets)
    have = [(g, n) for g, ws in lora.items() for n in ws]
    if sorted(have) != sorted(adapted):
        raise ValueError(f"the LoRA adapts {sorted(have)}, but targets {list(targets)} adapt {sorted(adapted)}")
    names = hf.tensor_names(cfg)
    tensors = {}
    for group, name in adapted:
        a, b = np.asarray(lora[group][name]["a"], np.float32), np.asarray(lora[group][name]["b"], np.float32)
        p = lora_stack_axes(group)
        if a.shape[p] != rank or b.shape[p] != rank:
            raise ValueError(f"LoRA weight {group}/{name} has rank {a.shape[p]}, not {rank}")
        for hf_name, index in names[(group, name)]:
            module = _PEFT_PREFIX + hf_name.removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[index].reshape(rank, -1))
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b[index].reshape(rank, -1).T)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": alpha, "target_modules": sorted(targets), "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
    }
    folder = epath.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER_WEIGHTS).write_bytes(safetensors.numpy.save(tensors, metadata={"format": "pt"}))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A LoRA read from a PEFT folder: factors with the structure of `lora_specs(cfg, rank, targets)`
    (fp32), and the scale `alpha / rank`."""

    lora: Params
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_model_name_or_path: str | None

    @property
    def lora_scale(self) -> float:
        return self.alpha / self.rank


def load_adapter(folder: str | epath.PathLike, cfg: ModelConfig) -> Adapter:
    """Read a PEFT LoRA adapter folder (as `save_adapter` writes, or peft's `save_pretrained` for a
    Qwen3 with the same `r` everywhere) into a jaxrl LoRA for `cfg`.

    Raises:
        FileNotFoundError: the folder lacks `adapter_config.json` or `adapter_model.safetensors`.
        ValueError: not a LoRA jaxrl can run (other peft types, rsLoRA, DoRA, per-module ranks, a regex
            `target_modules`, bias), or a tensor is missing, extra, or of the wrong shape.
    """
    folder = epath.Path(folder)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / f).exists():
            raise FileNotFoundError(f"adapter folder {folder} has no {f}")
    conf = json.loads((folder / ADAPTER_CONFIG).read_text())
    problems = [f"{k} = {conf.get(k)!r}" for k, ok in [
        ("peft_type", conf.get("peft_type") == "LORA"), ("use_rslora", not conf.get("use_rslora")),
        ("use_dora", not conf.get("use_dora")), ("rank_pattern", not conf.get("rank_pattern")),
        ("alpha_pattern", not conf.get("alpha_pattern")), ("bias", conf.get("bias", "none") == "none"),
        ("target_modules", isinstance(conf.get("target_modules"), list)),
        ("target_parameters", not conf.get("target_parameters"))] if not ok]
    if problems:
        raise ValueError(f"{folder / ADAPTER_CONFIG}: not a plain LoRA jaxrl can load: {', '.join(problems)}")
    rank, targets = int(conf["r"]), tuple(sorted(conf["target_modules"]))
    unknown = sorted(set(targets) - LORA_TARGETS.keys())
    if unknown:
        raise ValueError(f"{folder / ADAPTER_CONFIG}: target_modules {unknown} are not projections jaxrl adapts "
                         f"({sorted(LORA_TARGETS)})")
    tensors = dict(safetensors.numpy.load((folder / ADAPTER_WEIGHTS).read_bytes()))
    names = hf.tensor_names(cfg)
    dims = {**cfg.dims(), "R": rank}
    specs = lora_specs(cfg, rank, targets)
    lora: Params = {}
    for group, name in _adapted(cfg, targets):
        a = np.empty(specs[group][name]["a"].shape(dims), np.float32)
        b = np.empty(specs[group][name]["b"].shape(dims), np.float32)
        for hf_name, index in names[(group, name)]:
            module = _PEFT_PREFIX + hf_name.removesuffix(".weight")
            for key, dst in ((f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b)):
                if key not in tensors:
                    raise ValueError(f"{folder / ADAPTER_WEIGHTS}: tensor {key!r} is missing")
                t = tensors.pop(key)  # A [R, in]: ours; B [out, R]: ours transposed; axes split as HF flattens them
                want = dst[index].shape
                if t.ndim != 2 or t.size != math.prod(want) or t.shape[0 if dst is a else 1] != rank:
                    raise ValueError(f"{folder / ADAPTER_WEIGHTS}: tensor {key!r} has shape {tuple(t.shape)}, "
                                     f"which does not fit {want}")
                dst[index] = (t if dst is a else t.T).reshape(want)
        lora.setdefault(group, {})[name] = {"a": jnp.asarray(a), "b": jnp.asarray(b)}
    if tensors:
        raise ValueError(f"{folder / ADAPTER_WEIGHTS}: tensors {sorted(tensors)[:3]} are not part of a LoRA on "
                         f"{list(targets)} for this model ({len(tensors)} in all)")
    return Adapter(lora, rank, float(conf["lora_alpha"]), targets, conf.get("base_model_name_or_path"))
