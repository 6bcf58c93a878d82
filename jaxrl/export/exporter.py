"""A trained LoRA back to Hugging Face: a merged checkpoint (the LoRA folded into the base weights) that
`Qwen3ForCausalLM.from_pretrained` loads, or a PEFT adapter folder that `peft.PeftModel.from_pretrained`
loads onto the base model; an adapter folder read back into a jaxrl LoRA; the `[adapters]` exports of
a run; and `jaxrl export`, which finds a run's checkpoint and config and writes either.

PEFT's adapter format (peft 0.21): `adapter_config.json` (a `LoraConfig`) and `adapter_model.safetensors`
with, for every adapted Linear `<module>` of the HF model, `base_model.model.<module>.lora_A.weight`
[R, in] and `lora_B.weight` [out, R]; the update is `(lora_alpha / r) * B @ A`, which is jaxrl's
`lora_scale * a @ b` with `A = a.T`, `B = b.T` (heads flattened as HF flattens them). MoE experts are
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

from jaxrl.config.schema import (
    AdaptersConfig,
    ConfigError,
    RunConfig,
    load_config,
    resolve_model_path,
    resolve_tokenizer_path,
)
from jaxrl.model import hf
from jaxrl.model.qwen3 import LORA_TARGETS, ModelConfig, Params, init_lora, lora_specs, param_specs
from jaxrl.rl.train import TrainState, make_optimizer
from jaxrl.run import gcs
from jaxrl.run.checkpoint import Checkpointer, CheckpointError
from jaxrl.run.recovery import checkpoint_dir_of, checkpoint_root, identity_mismatch, model_identity, run_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RUN_CONFIG = "config.json"  # what `jaxrl run` writes into the run folder for `jaxrl export`
_PEFT_PREFIX = "base_model.model."
_N_IN = {name: n_in for name, n_in in LORA_TARGETS.values()}  # our weight name -> its input axes
_EXPERT_TARGETS = ("gate_proj", "up_proj")  # fused into one `gate_up_proj` by transformers 5
# Files a merged export copies so that it can be used as it is: from the tokenizer folder, and from the
# base model folder (sampling defaults).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")
_MODEL_FILES = ("generation_config.json",)


class ExportError(Exception):
    """An export that cannot be done: no such run or checkpoint, no config to read, or a LoRA that the
    target format cannot hold. The message says which and what to do."""


def _stack_axes(group: str) -> int:
    """Leading stack axes of a weight in `group` (as in `lora_specs`): layers, plus experts in `moe`."""
    return 2 if group == "moe" else 1


def _merged(w: jax.Array, a: jax.Array, b: jax.Array, scale: float | jax.Array, letters: str,
            n_stack: int, n_in: int) -> jax.Array:
    """`w + scale * a @ b` for one stacked weight with shape letters `letters`, computed in fp32 at
    full matmul precision and returned in `w`'s dtype."""
    pre, x, y = letters[:n_stack], letters[n_stack:n_stack + n_in], letters[n_stack + n_in:]
    delta = jnp.einsum(f"{pre}{x}R,{pre}R{y}->{letters}", a.astype(jnp.float32), b.astype(jnp.float32),
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
            p, n_in = _stack_axes(group), _N_IN[name]
            rank = ab["a"].shape[-1]
            want_a = (*w.shape[:p + n_in], rank)
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
        lora: the structure of `lora_specs(cfg, rank, targets)` (`a` [stack..., in..., R],
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
                                   _stack_axes(group), _N_IN[name])
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
                        n_stack=_stack_axes(group), n_in=_N_IN[name])
        merged[group][name] = np.asarray(w)
        del w
    return hf.save_hf(folder, cfg, merged, dtype=dtype)


def _adapted(cfg: ModelConfig, targets: tuple[str, ...]) -> list[tuple[str, str]]:
    """(group, weight) of every weight a LoRA on `targets` adapts, in `lora_specs` order."""
    return [(group, name) for group, weights in lora_specs(cfg, 1, targets).items() for name in weights]


def _check_peft_targets(cfg: ModelConfig, targets: tuple[str, ...]) -> None:
    """Raise ValueError for a LoRA that peft cannot load onto transformers 5's Qwen3-MoE."""
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
        raise ValueError(f"a PEFT adapter cannot hold MLP LoRA for a Qwen3-MoE with dense-MLP layers "
                         f"{list(cfg.mlp_layers)}: peft maps gate_proj/up_proj/down_proj to the experts "
                         "only when it loads the adapter; export the merged model instead")


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
    _check_peft_targets(cfg, targets)
    adapted = _adapted(cfg, targets)
    have = [(g, n) for g, ws in lora.items() for n in ws]
    if sorted(have) != sorted(adapted):
        raise ValueError(f"the LoRA adapts {sorted(have)}, but targets {list(targets)} adapt {sorted(adapted)}")
    names = hf.tensor_names(cfg)
    tensors = {}
    for group, name in adapted:
        a, b = np.asarray(lora[group][name]["a"], np.float32), np.asarray(lora[group][name]["b"], np.float32)
        if a.shape[-1] != rank or b.shape[_stack_axes(group)] != rank:
            raise ValueError(f"LoRA weight {group}/{name} has rank {a.shape[-1]}, not {rank}")
        for hf_name, index in names[(group, name)]:
            module = _PEFT_PREFIX + hf_name.removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[index].reshape(-1, rank).T)
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
        raise ValueError(f"{folder / ADAPTER_CONFIG}: target_modules {unknown} are not Qwen3 projections "
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
                t = tensors.pop(key)  # A [R, in] or B [out, R]: ours transposed, axes split as HF flattens them
                want = dst[index].shape
                if t.ndim != 2 or t.size != math.prod(want) or t.shape[0 if dst is a else 1] != rank:
                    raise ValueError(f"{folder / ADAPTER_WEIGHTS}: tensor {key!r} has shape {tuple(t.shape)}, "
                                     f"which does not fit {want}")
                dst[index] = t.T.reshape(want)
        lora.setdefault(group, {})[name] = {"a": jnp.asarray(a), "b": jnp.asarray(b)}
    if tensors:
        raise ValueError(f"{folder / ADAPTER_WEIGHTS}: tensors {sorted(tensors)[:3]} are not part of a LoRA on "
                         f"{list(targets)} for this model ({len(tensors)} in all)")
    return Adapter(lora, rank, float(conf["lora_alpha"]), targets, conf.get("base_model_name_or_path"))


def adapters_dir_of(cfg: RunConfig) -> str:
    """Where a run's `[adapters]` exports go: `adapters/` in the run's folder under its checkpoint root,
    i.e. `<output_dir>/<name>/adapters`, or `<checkpoint_dir>/<name>/adapters` (a folder or `gs://` URL)
    when `[jax] checkpoint_dir` is set. Orbax ignores it there: it lists only numbered step folders."""
    return gcs.join(checkpoint_root(cfg), run_name(cfg), "adapters")


class RunAdapters:
    """`[adapters]` of a run: the LoRA as a PEFT folder `<directory>/step_<n>` after every `interval`-th
    step (0: after the last step only) and after the last step, keeping the newest `keep_last` (-1: all).
    A local folder is written under a temporary name and then renamed; on `gs://` (no rename) the files
    are written in place, and a `step_<n>` counts (`steps`) only with both of its files. `directory` may be local or
    `gs://` (etils.epath). Only process 0 of a multi-host run writes.

    A LoRA that the PEFT format cannot hold (`save_adapter`) is a ConfigError when the config sets
    `[adapters]`; with the table left out, the run writes no adapters and says so on `console`. An
    adapter that cannot be written (storage down, disk full) is reported on `console` and the run goes
    on: the checkpoints hold the same LoRA, and `jaxrl export --adapter` writes it from one.
    """

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, directory: str | epath.PathLike,
                 console: Any | None = None) -> None:
        self.settings: AdaptersConfig = cfg.adapters
        self.max_steps = cfg.max_steps
        self.directory = epath.Path(directory)
        self.model_cfg = model_cfg
        self.rank, self.alpha, self.targets = cfg.jax.lora_rank, cfg.lora_alpha, tuple(cfg.jax.lora_targets)
        self.base_model = cfg.model
        self.console = console
        self.enabled = True
        try:
            _check_peft_targets(model_cfg, self.targets)
        except ValueError as exc:
            if "adapters" in cfg.model_fields_set:
                raise ConfigError(cfg.source, [("adapters", str(exc))]) from None
            self.enabled = False
            if console is not None:
                console.print(f"no PEFT adapters for this run: {exc}", style="yellow", markup=False,
                              highlight=False)

    def due(self, step: int) -> bool:
        """Whether an adapter is written after `step` (1-based)."""
        interval = self.settings.interval
        return step == self.max_steps or (interval > 0 and step % interval == 0)

    def after_step(self, step: int, lora: Params) -> epath.Path | None:
        """Write the adapter of `step` if it is due, then delete the oldest beyond `keep_last`; return
        its folder (None when none was written)."""
        if not self.enabled or not self.due(step):
            return None
        from jax.experimental import multihost_utils

        host = multihost_utils.process_allgather(lora, tiled=True)  # every host takes part
        if jax.process_index() != 0:
            return None
        final = self.directory / f"step_{step}"
        # gs:// has no rename (gcsfs copies object by object, noisily where moveTo is refused); its
        # single-object uploads are atomic, and a step counts only with both files, so write in place.
        tmp = final if gcs.is_gcs(str(self.directory)) else self.directory / f".tmp-step_{step}"
        try:
            for stale in {tmp, final}:
                if stale.exists():
                    stale.rmtree()
            save_adapter(tmp, self.model_cfg, host, rank=self.rank, alpha=self.alpha, targets=self.targets,
                         base_model_name_or_path=self.base_model)
            if tmp != final:
                tmp.rename(final)
            keep = self.settings.keep_last
            if keep > 0:
                for old in self.steps()[:-keep]:
                    (self.directory / f"step_{old}").rmtree()
        except Exception as exc:  # noqa: BLE001 - any storage failure (OSError, gcsfs' HttpError, ...)
            if self.console is not None:
                self.console.print(f"step {step}: PEFT adapter not written to {final}: {type(exc).__name__}: "
                                   f"{exc}", style="yellow", markup=False, highlight=False)
            return None
        return final

    def steps(self) -> list[int]:
        """Steps of the complete adapter folders (both files present), ascending."""
        if not self.directory.exists():
            return []
        return sorted(int(p.name[5:]) for p in self.directory.iterdir()
                      if p.name.startswith("step_") and p.name[5:].isdigit()
                      and (p / ADAPTER_CONFIG).exists() and (p / ADAPTER_WEIGHTS).exists())


def write_run_config(run_dir: Path, cfg: RunConfig) -> Path:
    """Write `<run_dir>/config.json`: the run's config (`model_dump`) and what it resolved to (model
    and tokenizer folders, checkpoint folder), so `jaxrl export` needs only the run folder."""
    resolved = {"source": str(cfg.source), "model_path": resolve_model_path(cfg),
                "tokenizer_path": resolve_tokenizer_path(cfg), "checkpoint_dir": checkpoint_dir_of(cfg)}
    path = run_dir / RUN_CONFIG
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"resolved": resolved, "config": cfg.model_dump(mode="json")}, indent=2) + "\n")
    tmp.replace(path)
    return path


@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint of a run and what is needed to export it."""

    checkpoint_dir: str
    step: int
    model: str  # the config's `model` (hub id), recorded as the adapter's base model
    model_path: str
    tokenizer_path: str
    lora_rank: int
    lora_alpha: int
    lora_targets: tuple[str, ...]
    dtype: str

    @classmethod
    def of(cls, cfg: RunConfig, checkpoint_dir: str, step: int) -> Source:
        return cls(checkpoint_dir, step, cfg.model, resolve_model_path(cfg), resolve_tokenizer_path(cfg),
                   cfg.jax.lora_rank, cfg.lora_alpha, tuple(cfg.jax.lora_targets), cfg.jax.dtype)


def _run_source(run_dir: Path) -> tuple[RunConfig, dict[str, str]] | None:
    """The config and resolved paths `write_run_config` stored in `run_dir`; None when there are none."""
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return RunConfig.model_validate(data["config"]), data["resolved"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path} is not a run config written by `jaxrl run` ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0]}); pass the run's TOML with --config") from None


def find_source(ref: str, step: int | None = None, config: str | Path | None = None) -> Source:
    """The checkpoint `ref` names: a run folder (`<output_dir>/<name>`, with the `config.json` that
    `jaxrl run` writes), a checkpoint folder (`<run>/checkpoints`, or a `gs://` one), or one step's
    folder (`<run>/checkpoints/12`). `step` picks a step (default: the step folder's, else the latest).
    `config` (the run's TOML) stands in for the run folder's `config.json`, which a checkpoint kept
    outside its run folder (`[jax] checkpoint_dir`, `gs://`) cannot be traced to.

    Raises:
        ExportError: no such folder or checkpoint step, no config to read (the message says what to
            pass), or a config whose model folder is missing.
    """
    run_cfg, resolved = None, None
    if config is not None:
        try:
            run_cfg = load_config(config)
        except ConfigError as exc:
            raise ExportError(str(exc)) from None
    ckpt_dir: str | None
    if gcs.is_gcs(ref):
        if run_cfg is None:
            raise ExportError(f"{ref}: pass the run's TOML with --config (a gs:// checkpoint has no run config)")
        head, _, last = ref.rstrip("/").rpartition("/")
        ckpt_dir, path_step = (head, int(last)) if last.isdigit() else (ref.rstrip("/"), None)
    else:
        p = Path(ref).expanduser().resolve()
        if not p.is_dir():
            raise ExportError(f"{ref} is not a folder (expected a run folder, a checkpoint folder or a step's)")
        if (p / RUN_CONFIG).is_file() or (p / "checkpoints").is_dir():  # a run folder
            run_dir, ckpt_dir, path_step = p, None, None
        elif p.name.isdigit():  # one step of `<run>/checkpoints`
            run_dir, ckpt_dir, path_step = p.parent.parent, str(p.parent), int(p.name)
        else:  # `<run>/checkpoints`
            run_dir, ckpt_dir, path_step = p.parent, str(p), None
        if run_cfg is None:
            if (found := _run_source(run_dir)) is None:
                raise ExportError(f"no run config for {ref}: {run_dir / RUN_CONFIG} does not exist (`jaxrl run` "
                                  "writes it); pass the run's TOML with --config")
            run_cfg, resolved = found
        if ckpt_dir is None:
            ckpt_dir = resolved["checkpoint_dir"] if resolved else checkpoint_dir_of(run_cfg)
    if step is not None and path_step is not None and step != path_step:
        raise ExportError(f"{ref} is step {path_step}, but --step {step} was given")
    step = step if step is not None else path_step
    if not gcs.is_gcs(ckpt_dir) and not Path(ckpt_dir).is_dir():
        raise ExportError(f"no checkpoints: {ckpt_dir} does not exist")
    try:
        ckpt = Checkpointer(ckpt_dir, read_only=True)
        steps = ckpt.all_steps()
        ckpt.close()
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    if not steps:
        raise ExportError(f"no complete checkpoint in {ckpt_dir}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"no checkpoint for step {step} in {ckpt_dir} (steps: {', '.join(map(str, steps))})")
    if resolved is not None:
        return Source(ckpt_dir, step, run_cfg.model, resolved["model_path"], resolved["tokenizer_path"],
                      run_cfg.jax.lora_rank, run_cfg.lora_alpha, tuple(run_cfg.jax.lora_targets), run_cfg.jax.dtype)
    try:
        return Source.of(run_cfg, ckpt_dir, step)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None


def restore_lora(source: Source, model_cfg: ModelConfig) -> Params:
    """The LoRA of `source`'s checkpoint, on the default device, after checking the checkpoint is of
    this model and LoRA shape.

    Raises:
        ExportError: the checkpoint cannot be read or is of another model or LoRA.
    """
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = source.lora_targets

    def abstract(tree: Any) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)

    lora = abstract(jax.eval_shape(lambda: init_lora(model_cfg, source.lora_rank, targets, jax.random.key(0))))
    base = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape(model_cfg.dims()), jnp.float32),
                        param_specs(model_cfg), is_leaf=lambda x: hasattr(x, "letters"))
    opt_state = abstract(jax.eval_shape(make_optimizer(1.0).init, {"base": base, "lora": lora}))
    like = TrainState(lora, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=device))
    identity = model_identity(source.model, dataclasses.asdict(model_cfg), source.lora_rank, targets)
    try:
        ckpt = Checkpointer(source.checkpoint_dir, read_only=True)
        try:
            if problems := identity_mismatch(ckpt.read_meta(source.step).get("identity"), identity):
                raise ExportError(f"checkpoint step {source.step} in {source.checkpoint_dir} is not of this "
                                  "run's model or LoRA: " + "; ".join(problems))
            state, _ = ckpt.restore(source.step, like)
        finally:
            ckpt.close()
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    return state.lora


def export(source: Source, out: str | Path, *, adapter: bool = False) -> Path:
    """Write `source`'s checkpoint to the local folder `out`: the merged model (base weights in the run's
    dtype, plus the tokenizer files of its tokenizer folder), or with `adapter` the PEFT adapter folder.

    Raises:
        ExportError: the checkpoint or the base model cannot be read, the adapter format cannot hold
            this LoRA, or `out` cannot be written (a file, no permission, disk full).
    """
    dtype = jnp.bfloat16 if source.dtype == "bfloat16" else jnp.float32
    try:
        model_cfg = hf.load_config(source.model_path)
        lora = restore_lora(source, model_cfg)
        params = None if adapter else hf.load_hf(source.model_path, dtype=dtype)[1]
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the base model {source.model_path}: {exc}") from None
    out = Path(out)
    try:
        if adapter:
            save_adapter(out, model_cfg, lora, rank=source.lora_rank, alpha=source.lora_alpha,
                         targets=source.lora_targets, base_model_name_or_path=source.model)
            return out
        save_merged(out, model_cfg, params, lora, source.lora_alpha / source.lora_rank)
        for folder, names in ((source.tokenizer_path, _TOKENIZER_FILES), (source.model_path, _MODEL_FILES)):
            for name in names:
                if (src := epath.Path(folder) / name).exists():  # the folders may be gs:// ones
                    (out / name).write_bytes(src.read_bytes())
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc}") from None
    return out
