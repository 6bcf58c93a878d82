"""`[adapters]` of a run: its LoRA written as PEFT adapter folders while it trains
(`<run folder>/adapters/step_<n>`, `jaxrl.run.layout.adapters_dir_of`)."""

from __future__ import annotations

from typing import Any

import jax
from etils import epath

from jaxrl.config.schema import AdaptersConfig, ConfigError, RunConfig
from jaxrl.model.blocks import Params
from jaxrl.model.config import ModelConfig
from jaxrl.model.hf_lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_peft_targets, save_adapter
from jaxrl.run import gcs


class RunAdapters:
    """`[adapters]` of a run: the LoRA as a PEFT folder `<directory>/step_<n>` after every `interval`-th
    step (0: after the last step only) and after the last step, keeping the newest `keep_last` (-1: all).
    A local folder is written under a temporary name and then renamed; on `gs://` (no rename) the files
    are written in place, and a `step_<n>` counts (`steps`) only with both of its files. `directory` may be local or
    `gs://` (etils.epath). Only process 0 of a multi-host run writes.

    A LoRA that the PEFT format cannot hold (`save_adapter`) is a ConfigError when the config sets
    `[adapters]`; with the table left out, the run writes no adapters and says so on `console`. An
    adapter that cannot be written (storage down, disk full) is reported on `console` and the run goes
    on: the checkpoints hold the same LoRA, and `jaxrl export --adapter` writes it from one. With `[jax]
    finetune = "full"` there is no LoRA and nothing is written (`jaxrl export` writes the whole model).
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
        self.enabled = cfg.jax.finetune == "lora"  # full fine-tuning has no LoRA: `jaxrl export` writes the model
        if not self.enabled:
            return
        try:
            check_peft_targets(model_cfg, self.targets)
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
        return adapter_steps(self.directory)


def adapter_steps(directory: str | epath.PathLike) -> list[int]:
    """Steps of the complete PEFT adapter folders `step_<n>` in `directory` (local or `gs://`; both files
    present), ascending; [] when there is no such folder."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    return sorted(int(p.name[5:]) for p in directory.iterdir()
                  if p.name.startswith("step_") and p.name[5:].isdigit()
                  and (p / ADAPTER_CONFIG).exists() and (p / ADAPTER_WEIGHTS).exists())
