"""On-policy distillation on an environment and a teacher that jaxrl does not ship (issue 42's demonstration).

    python scripts/distill_demo.py [--out runs/distill-demo]

writes into `--out` everything the three commands below need, nothing of it shipped with jaxrl:
- `env/shout/`: a verifiers v1 taskset, `demo/shout`, written here (not in `environments/`): "Reply using
  only UPPERCASE English letters and spaces." + a generated request; the reward is the fraction of the
  reply's characters that are `A`-`Z` or a space (dense, so a random policy already scores above 0);
  50 eval prompts, 400 train prompts, no download.
- `sft.jsonl`: an uppercase answer (reward 1) to each train prompt, never an eval one.
- `teacher.toml`: `jaxrl sft` of a LoRA (rank 8) on the tiny Qwen3 over `sft.jsonl`, 300 steps: the
  teacher, a run folder (`runs/shout-teacher`); its `[eval]` plays the eval split before step 1 (the
  base) and after steps 150 and 300.
- `student.toml`: `jaxrl run` of a fresh LoRA on the same tiny Qwen3, 30 steps, taught by that run's
  latest checkpoint (`[jax.teacher] model` names the run folder: its LoRA folded into the base) with
  `teacher_tau = 1`, `adv_tau = 0`: pure distillation, the reward logged but not trained on; `[eval]`
  every 5 steps and the base at step 0.

Then, from the repository root (docs/algorithms.md, "On-policy distillation", has the figures):

    PYTHONPATH=runs/distill-demo/env jaxrl sft runs/distill-demo/teacher.toml
    PYTHONPATH=runs/distill-demo/env jaxrl run runs/distill-demo/student.toml
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTRUCTION = "Reply using only UPPERCASE English letters and spaces."
TEMPLATES = ("Describe {} in a few words.", "Say something about {}.", "What do you like about {}?",
             "Name three things related to {}.", "Write a short sentence about {}.", "Where would you find {}?",
             "What color is {}?", "Tell me a fact about {}.", "Give a one line story about {}.")
SUBJECTS = ("a boat", "the rain", "a mountain", "bread", "a fox", "the sky", "a lamp", "the river", "a drum",
            "a tiger", "the snow", "a clock", "a pear", "the wind", "a tower", "a whale", "the moon", "soup",
            "a kite", "a forest", "a bell", "an owl", "the sun", "a rose", "a road", "a queen", "a train", "honey",
            "a cloud", "the sea", "a horse", "a cave", "milk", "a key", "a storm", "a lion", "a garden", "a coin",
            "a ship", "a star", "the night", "an apple", "a wolf", "a song", "a bridge", "the desert", "a book",
            "a candle", "an island", "a flag", "ice", "a market", "a bee", "the fire", "a map", "a hill")
ADJECTIVES = ("BIG", "OLD", "WARM", "BLUE", "GREEN", "QUIET", "BRIGHT", "SOFT", "WILD", "CALM", "DARK", "FAST")

ENV_SOURCE = '''"""shout: reply using only UPPERCASE English letters and spaces (written by scripts/distill_demo.py).

The reward is the fraction of the reply's characters that are A-Z or a space. Prompts: an instruction and
a generated request (template x subject), shuffled by a seeded generator; the first `num_eval_examples`
are the eval split, the next `num_train_examples` the train split.
"""

import itertools
import random
import string
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

INSTRUCTION = {instruction!r}
TEMPLATES = {templates!r}
SUBJECTS = {subjects!r}
ALLOWED = frozenset(string.ascii_uppercase + " ")


def uppercase_fraction(reply: str) -> float:
    """Fraction of `reply`'s characters that are A-Z or a space; 0.0 for an empty reply."""
    return sum(ch in ALLOWED for ch in reply) / len(reply) if reply else 0.0


def requests(seed: int) -> list[str]:
    """Every request, in the seeded order both splits are cut from."""
    out = [t.format(s) for t, s in itertools.product(TEMPLATES, SUBJECTS)]
    random.Random(seed).shuffle(out)
    return out


class ShoutData(vf.TaskData):
    pass


class ShoutTask(vf.Task[ShoutData]):
    @vf.reward(weight=1.0)
    async def uppercase_fraction(self, trace: vf.Trace) -> float:
        return uppercase_fraction(trace.last_reply)


class ShoutConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    num_train_examples: int = Field(400, ge=1)
    num_eval_examples: int = Field(50, ge=1)
    seed: int = 0


class ShoutTaskset(vf.Taskset[ShoutTask, ShoutConfig]):
    def load(self):
        c = self.config
        every = requests(c.seed)
        chosen = every[:c.num_eval_examples] if c.split == "eval" else \\
            every[c.num_eval_examples:c.num_eval_examples + c.num_train_examples]
        for i, request in enumerate(chosen):
            yield ShoutTask(ShoutData(name=f"{{c.split}}-{{i}}", prompt=f"{{INSTRUCTION}} {{request}}"), c.task)


__all__ = ["ShoutTaskset"]
'''

COMMON = """model = "jaxrl/qwen3-tiny"
max_steps = {max_steps}
learning_rate = {learning_rate}

[sampling]
max_tokens = 24
temperature = 1.0

[eval]
interval = {eval_interval}
num_examples = 50
eval_base_model = true

[checkpoints]
interval = {checkpoint_interval}

[jax]
model_path = "{model_path}"
seq_len = 256
decode_slots = 32
"""


def requests(seed: int = 0) -> list[tuple[str, str]]:
    """(request, subject) pairs in the order the written taskset draws its splits (`ENV_SOURCE`'s `requests`)."""
    pairs = [(t.format(s), s) for t, s in itertools.product(TEMPLATES, SUBJECTS)]
    random.Random(seed).shuffle(pairs)
    return pairs


def answer(subject: str, rng: random.Random) -> str:
    """A short reply about `subject` in uppercase letters and spaces only."""
    a, b = rng.sample(ADJECTIVES, 2)
    return rng.choice((f"{subject.upper()} IS {a} AND {b}", f"I LIKE {subject.upper()}", f"{a} {subject.upper()}"))


def sft_rows(num_train: int = 400, num_eval: int = 50, seed: int = 0) -> list[dict[str, str]]:
    """A prompt/completion pair per train prompt, each completion of reward 1."""
    rng = random.Random(seed)
    return [{"prompt": f"{INSTRUCTION} {request}", "completion": answer(subject, rng)}
            for request, subject in requests()[num_eval:num_eval + num_train]]


def write(out: Path, force: bool = False) -> None:
    """Write the environment, the SFT data and both configs into `out`.

    Raises:
        FileExistsError: one of the files it writes is already there and not `force`.
    """
    package = out / "env" / "shout"
    there = [p for p in (package / "__init__.py", out / "sft.jsonl", out / "teacher.toml", out / "student.toml")
             if p.exists()]
    if there and not force:
        raise FileExistsError(f"{there[0]} exists; pass --force to write over the demo's files in {out}")
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(ENV_SOURCE.format(instruction=INSTRUCTION, templates=TEMPLATES,
                                                           subjects=SUBJECTS), encoding="utf-8")
    rows = sft_rows()
    assert all(set(r["completion"]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ ") for r in rows)
    (out / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    model_path = os.path.relpath(REPO / "assets" / "qwen3-tiny", out.resolve())
    teacher_run = os.path.relpath(REPO / "runs" / "shout-teacher", out.resolve())
    lora = "lora_alpha = 16\n"
    (out / "teacher.toml").write_text(
        'name = "shout-teacher"\n' + lora + COMMON.format(max_steps=300, learning_rate=1e-2, eval_interval=150,
                                                          checkpoint_interval=150, model_path=model_path)
        + 'lora_rank = 8\n\n[jax.sft]\ndata = "sft.jsonl"\nbatch_size = 4\n\n[[eval.env]]\nid = "demo/shout"\n',
        encoding="utf-8")
    (out / "student.toml").write_text(
        'name = "shout-student"\nbatch_size = 32\nrollouts_per_example = 8\n' + lora
        + COMMON.format(max_steps=30, learning_rate=1e-2, eval_interval=5, checkpoint_interval=5,
                        model_path=model_path)
        + f'lora_rank = 8\n\n[jax.loss]\nteacher_tau = 1.0\nadv_tau = 0.0\n\n[jax.teacher]\nmodel = "{teacher_run}"'
          '   # the teacher run\'s folder: its latest checkpoint, LoRA folded in\n\n[[env]]\nid = "demo/shout"\n',
        encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/distill-demo"), help="folder to write (default: "
                        "runs/distill-demo, relative to the working directory)")
    parser.add_argument("--force", action="store_true", help="write over the demo's own files (the environment, "
                        "sft.jsonl, teacher.toml, student.toml) where --out already has them")
    args = parser.parse_args()
    try:
        write(args.out, args.force)
    except FileExistsError as e:
        print(f"distill_demo: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {args.out}/env/shout, sft.jsonl, teacher.toml and student.toml")


if __name__ == "__main__":
    main()
