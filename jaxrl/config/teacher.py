"""`[jax.teacher]`: the teacher of on-policy distillation, and the checks a config with one gets at load.

On-policy distillation (Thinking Machines, "On-Policy Distillation", 2025; prime-rl's `teacher_tau`) trains
the student on its own rollouts with a dense per-token signal: for every sampled token t the advantage
`sg[log p_teacher(t) - log p_student(t)]` (the reverse KL on the sampled tokens), weighted by `[jax.loss]
teacher_tau` and added to `adv_tau` times the reward advantage (`jaxrl.rl.losses.policy_loss`). The teacher
is a frozen model scored in the train step (`model`), or an OpenAI-compatible server asked for the
logprobs of the sampled tokens (`base_url` + `model_name`). Its tokenizer must be the student's: the
logprobs are of the student's token ids, so a teacher of another vocabulary is refused before the run
trains: a local model folder here, at load (`vocabulary_mismatch`); a jaxrl run by `jaxrl validate`
(`jaxrl.cli.common.check_run_teacher`); a `gs://` folder, a Hub id not yet downloaded and a jaxrl run
when the run finds them (`jaxrl.run.teacher`); a server by a probe
(`jaxrl.rl.teacher_client.check_server`). No JAX import here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pydantic import Field, model_validator

from jaxrl.config.base import BrokenRules, PathStr, Table
from jaxrl.config.model_path import ModelNotFoundError, locate_model

Reader = Callable[[str, str], "str | None"]
"""`read(folder, name)`: the text of a tokenizer folder's file `name`, None when it has none."""


class TeacherConfig(Table):
    """`[jax.teacher]`: where the teacher's logprobs come from; exactly one of `model` and `base_url`."""

    model: PathStr | None = None
    """A frozen model scored in the train step, one more forward pass over the batch per step (as the KL
    reference is), its weights placed and sharded on the run's mesh by the student's rules, in `[jax]
    dtype`: a Hugging Face folder (relative to the config file), `gs://` URL or Hub id
    (`owner/name[@revision]`, downloaded into the HF cache), found as `model` is
    (`jaxrl.config.model_path`); or, as `jaxrl serve` takes one, a local jaxrl run folder, its checkpoints
    folder or one step's folder (`jaxrl.run.trained`: the latest step, or that step; its LoRA folded into
    its run's base model, or its full fine-tuning weights). Its architecture may differ from the student's
    (a larger Qwen3, dense or MoE); its vocabulary may not. Not saved in checkpoints. Default None."""
    base_url: str | None = None
    """An OpenAI-compatible server's base URL (`http://host:port/v1`) asked for the logprobs of each
    trained sample's tokens while the batch is assembled: vLLM (`prompt_logprobs` on `/v1/completions`) or
    `jaxrl serve`. Needs `model_name`. Default None."""
    model_name: str | None = None
    """The model name the server serves (`/v1/models`); with `base_url` only. Default None."""
    api_key_var: str | None = None
    """Environment variable holding the server's API key (sent as a bearer token). Default None: none sent."""
    max_concurrent: int = Field(8, ge=1)
    """Requests to the server in flight at once. Default 8."""
    timeout: float = Field(120.0, gt=0)
    """Seconds one request to the server may take. Default 120."""
    retries: int = Field(2, ge=0)
    """Times a failed request is retried (after 1, 2, 4, ... s); a sample whose logprobs still do not come
    is dropped from the step and counted in `teacher/failed`. Default 2."""

    @model_validator(mode="after")
    def _one_source(self) -> TeacherConfig:
        problems = []
        if (self.model is None) == (self.base_url is None):
            problems.append(("jax.teacher", "set one of model (a model scored in process) and base_url (a "
                                            "server), not " + ("both" if self.model else "neither")))
        if self.base_url is not None and self.model_name is None:
            problems.append(("jax.teacher.model_name", "required with base_url (the model the server serves)"))
        if self.model_name is not None and self.base_url is None:
            problems.append(("jax.teacher.model_name", "names a server's model: set base_url too"))
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            problems.append(("jax.teacher.base_url", f"{self.base_url!r} is not an http:// or https:// URL"))
        if problems:
            raise BrokenRules(problems)
        return self


def teacher_rules(teacher: TeacherConfig | None, teacher_tau: float, adv_tau: float,
                  sft: bool) -> list[tuple[str, str]]:
    """`(key, reason)` for each broken rule between `[jax.teacher]` and `[jax.loss]`: a teacher needs
    `teacher_tau > 0` (it would cost a forward pass for nothing) and `teacher_tau > 0` a teacher; with
    both taus 0 nothing trains; an SFT config has no teacher (it trains on its data)."""
    if sft:
        return [("jax.teacher", "an SFT config trains on its data; a teacher is for `jaxrl run`")] if teacher else []
    problems = []
    if teacher is None and teacher_tau > 0:
        problems.append(("jax.loss.teacher_tau", f"{teacher_tau} needs a teacher: add [jax.teacher] with model "
                                                 f"or base_url"))
    if teacher is not None and teacher_tau == 0:
        problems.append(("jax.teacher", "has no effect with [jax.loss] teacher_tau = 0; set teacher_tau > 0 "
                                        "(1.0, with adv_tau = 0, is pure distillation) or remove the table"))
    if teacher_tau == 0 and adv_tau == 0:
        problems.append(("jax.loss.adv_tau", "0 with teacher_tau 0 leaves nothing to learn from"))
    return problems


def _read_local(folder: str, name: str) -> str | None:
    """The text of the local file `folder/name`, None when there is none."""
    path = Path(folder) / name
    return path.read_text(encoding="utf-8") if path.is_file() else None


def vocabulary(folder: str | Path, read: Reader = _read_local) -> dict[str, int]:
    """A tokenizer folder's vocabulary, token string -> id, read from its `tokenizer.json` (the model's
    vocabulary plus `added_tokens`), else `vocab.json` plus `added_tokens.json`: the files, no tokenizer
    library (this runs at config load). `read(folder, name)` gives a file's text or None (default: a local
    folder; the run reads `gs://` ones through `etils.epath`).

    Raises:
        ValueError: neither file exists, or it is not a tokenizer's JSON (naming the file).
    """
    folder = str(folder)
    name, text = "tokenizer.json", read(folder, "tokenizer.json")
    if text is None:
        name, text = "vocab.json", read(folder, "vocab.json")
    if text is None:
        raise ValueError(f"no tokenizer in {folder} (neither tokenizer.json nor vocab.json)")
    try:
        if name == "vocab.json":
            added = read(folder, "added_tokens.json")
            return {**json.loads(text), **(json.loads(added) if added is not None else {})}
        data = json.loads(text)
        vocab = data["model"]["vocab"]
        if isinstance(vocab, list):  # Unigram: [piece, score] pairs in id order
            vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
        return {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens", [])}}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder}/{name} is not a tokenizer's JSON ({type(exc).__name__}: {exc})") from None


def vocabulary_mismatch(student: str | Path, teacher: str | Path, read: Reader = _read_local) -> str | None:
    """Why the tokenizer folder `teacher` cannot teach a student whose tokenizer folder is `student` (one
    line: the sizes and the first token id they disagree on), or None when their vocabularies are equal.
    `read` as `vocabulary`'s.

    Raises:
        ValueError: either folder holds no readable tokenizer (`vocabulary`).
    """
    mine, theirs = vocabulary(student, read), vocabulary(teacher, read)
    if mine == theirs:
        return None
    by_id, their_by_id = {i: t for t, i in mine.items()}, {i: t for t, i in theirs.items()}
    first = min(i for i in by_id.keys() | their_by_id.keys() if by_id.get(i) != their_by_id.get(i))
    return (f"the teacher's tokenizer ({teacher}, {len(theirs)} tokens) is not the student's ({student}, "
            f"{len(mine)} tokens): token id {first} is {their_by_id.get(first)!r} there, {by_id.get(first)!r} "
            f"here; distillation scores the student's token ids, so the teacher must share its vocabulary")


def teacher_file_problems(teacher: TeacherConfig | None, config_dir: Path,
                          student_tokenizer: str | None) -> list[tuple[str, str]]:
    """At load, without the network: `[jax.teacher] model` must be found (`locate_model`: a folder, `gs://`
    URL or Hub id), and when it is a local model folder (a `config.json`) and the student's tokenizer
    folder (`student_tokenizer`, None when not on this machine yet) is local too, their vocabularies must
    be equal (`vocabulary_mismatch`). A Hub teacher not yet downloaded, a `gs://` one and a jaxrl run or
    checkpoint (whose tokenizer its run config names) are compared when the run finds them, before any
    weight loads (`jaxrl.run.teacher`)."""
    if teacher is None or teacher.model is None:
        return []
    try:
        found = locate_model(teacher.model, config_dir)
    except ModelNotFoundError as exc:
        return [("jax.teacher.model", str(exc))]
    if not isinstance(found, str) or not (Path(found) / "config.json").is_file() or student_tokenizer is None:
        return []
    try:
        reason = vocabulary_mismatch(student_tokenizer, found)
    except ValueError as exc:
        reason = str(exc)
    return [("jax.teacher.model", reason)] if reason else []
