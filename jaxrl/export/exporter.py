"""`jaxrl export`: a run's checkpoint (a run folder, a checkpoint folder or one step's, local or `gs://`;
found and restored by `jaxrl.run.trained`, whose names this module re-exports) written to Hugging Face
format: merged weights or a PEFT adapter (`jaxrl.model.hf_lora`); a full fine-tuning checkpoint
(`[jax] finetune = "full"`) is written as the whole model (`jaxrl.model.hf.save_hf`). Where it may write
and how: `jaxrl.export.target`.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from etils import epath
from safetensors import SafetensorError

from jaxrl.export.target import ExportError, Manifest, check_target, write_folder
from jaxrl.model import hf
from jaxrl.model.hf_lora import save_adapter, save_merged
from jaxrl.run.trained import Source, SourceError, find_source, restore_lora, restore_trained

__all__ = ["ExportError", "Source", "SourceError", "export", "find_source", "restore_lora", "restore_trained"]

# Files a merged export copies so that it can be used as it is: from the tokenizer folder, and from the
# base model folder (sampling defaults).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")
_MODEL_FILES = ("generation_config.json",)


def export(source: Source, out: str | Path, *, adapter: bool = False, force: bool = False) -> Path:
    """Write `source`'s checkpoint to the local folder `out`: the merged model (base weights in the run's
    dtype, plus the tokenizer files of its tokenizer folder), or with `adapter` the PEFT adapter folder.
    A full fine-tuning checkpoint is the model itself: its weights, in the run's dtype (the weights its
    rollout engine sampled with), plus the tokenizer files. `out` must be new or empty, or with `force`
    an earlier export of the same kind; it is never the run's base model or tokenizer folder, and it is
    written whole or not at all (`jaxrl.export.target`).

    Raises:
        ExportError: `out` is refused (`target.check_target`), the base model cannot be read, the adapter
            format cannot hold this LoRA (or the checkpoint has none: full fine-tuning), or `out` cannot be
            written (a file, no permission, disk full).
        SourceError: the checkpoint cannot be read or is of another model or LoRA (`restore_trained`).
    """
    dtype = jnp.bfloat16 if source.dtype == "bfloat16" else jnp.float32
    full = source.finetune == "full"
    if full and adapter:
        raise ExportError(f"checkpoint step {source.step} in {source.checkpoint_dir} is of full fine-tuning "
                          "([jax] finetune = \"full\"): it has no LoRA adapter; export the model (--merged)")
    out = Path(out)
    kind = "adapter" if adapter else "merged"
    check_target(out, kind, force=force, protected={
        source.model_path: "the run's base model folder", source.tokenizer_path: "the run's tokenizer folder"})
    try:
        model_cfg = hf.load_config(source.model_path)
        state = restore_trained(source, model_cfg)
        params = None if adapter or full else hf.load_hf(source.model_path, dtype=dtype)[1]
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the base model {source.model_path}: {exc}") from None

    def fill(folder: Path) -> None:
        if adapter:
            save_adapter(folder, model_cfg, state.lora, rank=source.lora_rank, alpha=source.lora_alpha,
                         targets=source.lora_targets, base_model_name_or_path=source.model)
            return
        if full:
            hf.save_hf(folder, model_cfg, state.base, dtype=dtype)
        else:
            save_merged(folder, model_cfg, params, state.lora, source.lora_alpha / source.lora_rank)
        for src_folder, names in ((source.tokenizer_path, _TOKENIZER_FILES), (source.model_path, _MODEL_FILES)):
            for name in names:
                if (src := epath.Path(src_folder) / name).exists():  # the folders may be gs:// ones
                    (folder / name).write_bytes(src.read_bytes())

    try:
        write_folder(out, lambda files: Manifest(kind, source.checkpoint_dir, source.step, tuple(files)), fill)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ExportError(f"cannot write {out}: {reason}; nothing was written") from None
    return out
