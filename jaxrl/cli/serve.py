"""`jaxrl serve`: the inference server over a Hugging Face model folder or a run's checkpoint.

A folder holding safetensors weights is served as it is (`jaxrl.model.hf.load_hf`); anything else is read
as a run, its checkpoints folder or one step's (`jaxrl.export.exporter.find_source`): the run's base model,
with the checkpoint's LoRA applied at `lora_alpha / lora_rank`, and the run's tokenizer. The weights
are sharded over every visible device (or `mesh`), as in `jaxrl run`; one `Engine` + `Scheduler` serve
them, behind `jaxrl.inference.server` (OpenAI chat completions, vLLM's token route, `/v1/models`, `/health`)
or, with `--jetstream`, behind JetStream's gRPC server (`start_jetstream`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config.hub import resolve_model
from jaxrl.config.model_path import HubModel, ModelNotFoundError, locate_model
from jaxrl.inference.chunked import make_scheduler
from jaxrl.inference.engine import Engine
from jaxrl.inference.protocol import SamplingParams
from jaxrl.inference.scheduler import Scheduler
from jaxrl.inference.template import ChatTemplate
from jaxrl.model import hf
from jaxrl.model.modules import lora_specs, param_specs
from jaxrl.parallel.sharding import make_mesh, spec_shardings


class ServeError(Exception):
    """The model cannot be served: what is wrong and where (no traceback for the user)."""


@dataclasses.dataclass
class Loaded:
    """What `load` found: the scheduler serving the weights, the chat template, and a line saying what
    is being served."""

    scheduler: Scheduler
    chat_template: ChatTemplate
    description: str


def is_hf_folder(ref: str) -> bool:
    """Whether `ref` is a Hugging Face model folder: a `config.json` and safetensors weights."""
    p = Path(ref).expanduser()
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _hub_id(ref: str) -> bool:
    """Whether `ref`, no path on this machine, names a Hugging Face model (`owner/name[@rev]`): in the HF
    cache (`locate_model` gives its snapshot folder) or to download."""
    try:
        found = locate_model(ref)
    except ModelNotFoundError:
        return False
    return isinstance(found, HubModel) or not found.startswith("gs://")


def load(ref: str, *, name: str | None = None, decode_slots: int = 32, seq_len: int = 4096,
         step: int | None = None, config: str | Path | None = None, dtype: str | None = None,
         mesh_shape: dict[str, int] | None = None, seed: int = 0,
         decode_steps_per_dispatch: int | None = None) -> Loaded:
    """Load `ref` (a HF folder, or a run/checkpoint as `jaxrl export` takes it, with `step` and
    `config`) and start a scheduler over it.

    Args:
        name: the model name clients send and `/v1/models` lists (default: `ref` as given).
        decode_slots: sequences decoded at once (more requests wait in the queue).
        seq_len: tokens per sequence, prompt and completion (the KV cache length).
        dtype: "float32" or "bfloat16" weights; default: the run's, float32 for a HF folder.
        mesh_shape: mesh axis sizes (`jaxrl.parallel.sharding.MESH_AXES`); default: every device on fsdp.
        seed: base seed of requests that send none.
        decode_steps_per_dispatch: decode steps a program (`jaxrl.inference.engine.Engine`); default: the
            engine's (`DECODE_STEPS_PER_DISPATCH`).

    Raises:
        ServeError: no such model, checkpoint or tokenizer, a tokenizer without a chat template, a
            mesh that does not fit the devices, or weights that do not load.
    """
    from jaxrl.export import exporter as export  # pulls in the trainer's modules: only a checkpoint needs them

    lora, lora_scale, source = None, 0.0, None
    if is_hf_folder(ref):
        model_path = tokenizer_path = str(Path(ref).expanduser())
    elif not Path(ref).expanduser().exists() and _hub_id(ref):
        try:  # an `owner/name[@rev]` id that is no path here: from the HF cache, else downloaded from the Hub
            model_path = tokenizer_path = resolve_model(ref)
        except ModelNotFoundError as exc:
            raise ServeError(str(exc)) from None
    else:
        try:
            source = export.find_source(ref, step, config)
        except export.SourceError as exc:
            raise ServeError(f"{ref} is not a model folder (config.json + safetensors), a Hugging Face id nor a "
                             f"run's checkpoint: {exc}") from None
        model_path, tokenizer_path = source.model_path, source.tokenizer_path
    dtype = dtype or (source.dtype if source else "float32")
    try:
        mesh = make_mesh(mesh_shape or {})
    except ValueError as exc:
        raise ServeError(f"--mesh: {exc}") from None
    try:
        mcfg = hf.load_config(model_path)
        _, base = hf.load_hf(model_path, dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32,
                             shardings=spec_shardings(param_specs(mcfg), mcfg.dims(), mesh))
    except (OSError, ValueError) as exc:
        raise ServeError(f"cannot load the model from {model_path}: {exc}") from None
    if source is not None:
        try:
            restored = export.restore_trained(source, mcfg)
        except export.SourceError as exc:
            raise ServeError(str(exc)) from None
        if restored.base is not None:  # full fine-tuning: the checkpoint's weights replace the base
            base = jax.device_put(jax.tree.map(lambda x, b: x.astype(b.dtype), restored.base, base),
                                  jax.tree.map(lambda b: b.sharding, base))
        else:
            dims = {**mcfg.dims(), "R": source.lora_rank}
            lora = jax.device_put(restored.lora, spec_shardings(lora_specs(mcfg, source.lora_rank,
                                                                           source.lora_targets), dims, mesh))
            lora_scale = source.lora_alpha / source.lora_rank
    try:
        template = ChatTemplate.load(tokenizer_path, model_path)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if seq_len < 2:
        raise ServeError(f"--seq-len must be >= 2, got {seq_len}")
    if decode_slots < 1:
        raise ServeError(f"--decode-slots must be >= 1, got {decode_slots}")
    steps = {} if decode_steps_per_dispatch is None else {"decode_steps_per_dispatch": decode_steps_per_dispatch}
    engine = Engine(mcfg, mesh, decode_slots, seq_len, lora_scale=lora_scale,
                    cache_dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32, **steps)
    scheduler = make_scheduler(engine, {"base": base, "lora": lora}, model_name=name or ref, seed=seed)
    what = model_path
    if source:
        trained = "full fine-tuning of" if source.finetune == "full" else f"LoRA r{source.lora_rank} on"
        what = f"checkpoint step {source.step} of {source.checkpoint_dir} ({trained} {model_path})"
    return Loaded(scheduler, template, f"{what}, {dtype}, mesh {dict(mesh.shape)}, "
                                       f"{engine.decode_steps_per_dispatch} decode steps a dispatch")


def warmup(scheduler: Scheduler) -> int:
    """Compile every prefill bucket and the decode steps for plain and truncated sampling (what chat
    clients send most), so that first requests do not wait for XLA; returns the buckets compiled."""

    async def both() -> int:
        await scheduler.warmup(SamplingParams(top_p=0.9))
        return await scheduler.warmup(SamplingParams())

    return asyncio.run(both())


def start_jetstream(loaded: Loaded, host: str, port: int) -> Any:
    """JetStream's gRPC server over the loaded engine and weights (`jaxrl.inference.jetstream.serve`), with the
    served tokenizer and its end-of-turn ids; `stop()` ends it. Needs the jetstream extra.

    Raises:
        ServeError: JetStream cannot serve this model or tokenizer.
        OSError: it cannot listen on `host:port`.
    """
    from jaxrl.inference import jetstream as js  # the jetstream extra (TensorFlow): only `--jetstream` needs it

    template, scheduler = loaded.chat_template, loaded.scheduler
    try:
        tokenizer = js.HFTokenizer(template.tokenizer.backend_tokenizer, template.stop_token_ids)
        return js.serve(js.JetStreamEngine(scheduler.engine, scheduler.params.weights(), tokenizer), port, host)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
