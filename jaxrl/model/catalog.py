"""The models jaxrl trains: supported architectures, the Hosted Training model names, and where a model
name is found on this machine (a local folder, a `gs://` URL, or the local Hugging Face cache).

Nothing here imports JAX, so `jaxrl validate` stays fast. The architecture facts below are those of each
model's published `config.json`; a checkpoint's own `config.json` always wins when it is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3 (dense)", "Qwen3MoeForCausalLM": "qwen3_moe (mixture of experts)"}

_QWEN3_4B: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": 151_936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": True, "rope_theta": 5_000_000.0, "max_position_embeddings": 262_144,
}
_QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "rope_theta": 10_000_000.0, "max_position_embeddings": 262_144,
}
_QWEN3_235B_A22B: dict[str, Any] = {
    "model_type": "qwen3_moe", "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 12_288,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "rope_theta": 5_000_000.0, "max_position_embeddings": 262_144,
}

# Hosted Training model name -> its HF config.json architecture fields.
HOSTED_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-4B-Instruct-2507": _QWEN3_4B,
    "Qwen/Qwen3-4B-Thinking-2507": _QWEN3_4B,
    "Qwen/Qwen3-30B-A3B-Instruct-2507": _QWEN3_30B_A3B,
    "Qwen/Qwen3-30B-A3B-Thinking-2507": _QWEN3_30B_A3B,
    "Qwen/Qwen3-235B-A22B-Instruct-2507": _QWEN3_235B_A22B,
    "Qwen/Qwen3-235B-A22B-Thinking-2507": _QWEN3_235B_A22B,
}


class ModelNotFoundError(FileNotFoundError):
    """No checkpoint for a model name; the message lists every place that was looked in."""


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of `owner/name` in the local HF cache that holds a `config.json` (the one
    `refs/main` points at, else the newest), or None."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    main = repo / "refs" / "main"
    if main.is_file() and (snapshots / main.read_text().strip() / "config.json").is_file():
        return snapshots / main.read_text().strip()
    found = [p for p in snapshots.iterdir() if (p / "config.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model(where: str, base_dir: Path = Path(".")) -> str:
    """The checkpoint location for a model name: a `gs://` URL as given; a local folder (relative to
    `base_dir`); else, for an `owner/name` id, its snapshot in the local HF cache.

    Raises:
        ModelNotFoundError: none of these holds it (the message names each place looked in).
    """
    if where.startswith("gs://"):
        return where
    folder = base_dir / Path(where).expanduser()
    if folder.is_dir():
        return str(folder.resolve())
    looked = [f"no folder {folder}"]
    if where.count("/") == 1 and not where.startswith((".", "/", "~")):
        if (snapshot := find_in_hf_cache(where)) is not None:
            return str(snapshot)
        looked.append(f"not in the Hugging Face cache {hf_cache_dir()}")
    raise ModelNotFoundError(f"model {where!r} not found: {'; '.join(looked)} (nothing is downloaded)")
