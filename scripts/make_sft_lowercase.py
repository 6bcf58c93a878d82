"""Write the shipped SFT example's data: `configs/data/sft_lowercase.jsonl`, one prompt/completion pair per
prompt of the `jaxrl/lowercase` environment's train split (its default 400, seed 0; never its eval
split), each answered in lowercase letters and spaces only, so every completion scores reward 1.

    python scripts/make_sft_lowercase.py [--out FILE] [--seed N]

The answers are built from the prompt's subject and a few word lists (seeded), e.g. "Describe the sea in a
few words." -> "the sea is calm and blue". configs/sft_lowercase.toml trains on it (`jaxrl sft`);
configs/rl_from_sft.toml then runs RL from its checkpoint (docs/sft.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

from lowercase.taskset import INSTRUCTION, SUBJECTS, TEMPLATES, lowercase_fraction

ADJECTIVES = ("calm", "bright", "quiet", "warm", "soft", "old", "small", "green", "blue", "gentle", "wild", "happy")
VERBS = ("makes me smile", "feels like home", "is good to see", "brings joy", "is full of life", "is lovely")


def answer(subject: str, rng: random.Random) -> str:
    """A short reply about `subject` in lowercase letters and spaces only."""
    a, b = rng.sample(ADJECTIVES, 2)
    return rng.choice((f"{subject} is {a} and {b}", f"{subject} {rng.choice(VERBS)}",
                       f"i like {subject} because it is {a}"))


def rows(seed: int, num_train: int = 400, num_eval: int = 50, env_seed: int = 0) -> list[dict[str, str]]:
    """The prompt/completion pairs of the environment's train split (as `LowercaseTaskset.load` draws it)."""
    requests = [(t.format(s), s) for t, s in itertools.product(TEMPLATES, SUBJECTS)]
    random.Random(env_seed).shuffle(requests)
    rng = random.Random(seed)
    out = []
    for request, subject in requests[num_eval:num_eval + num_train]:
        completion = answer(subject, rng)
        assert lowercase_fraction(completion) == 1.0, completion
        out.append({"prompt": f"{INSTRUCTION} {request}", "completion": completion})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "configs/data/sft_lowercase.jsonl"
    parser.add_argument("--out", type=Path, default=default, help=f"output file (default: {default})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = rows(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    print(f"wrote {len(data)} conversations to {args.out}")


if __name__ == "__main__":
    main()
