"""Build the offline assets: `assets/qwen3-tiny`, `assets/qwen3-tiny-moe` and `assets/glm-tiny` (random tiny
Qwen3, Qwen3-MoE and GLM-4.5 MoE; the Qwen3 ones with the real tokenizer, the GLM one with its stand-in).

    python scripts/make_assets.py                     # both, unless already complete
    python scripts/make_assets.py --force             # rebuild it
    python scripts/make_assets.py --tokenizer-only DIR  # just the tokenizer files, into DIR
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxrl.model import assets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("assets"), help="assets folder (default: assets)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    parser.add_argument("--tokenizer-only", type=Path, metavar="DIR", help="write only the tokenizer to DIR")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    if args.tokenizer_only is not None:
        folder = assets.build_tokenizer(args.tokenizer_only)
        folders = [folder]
    else:
        folders = []
        for kind, name in (({}, assets.TINY_MODEL_DIR), ({"moe": True}, assets.TINY_MOE_DIR),
                           ({"glm": True}, assets.TINY_GLM_DIR)):
            target = args.root / name
            if args.force and target.exists():
                shutil.rmtree(target)
            was_complete = assets.is_complete(target)
            folders.append(assets.ensure_tiny_assets(args.root, **kind))
            if was_complete:
                print(f"{target} is already complete (use --force to rebuild)")
    for folder in folders:
        for path in sorted(folder.iterdir()):
            print(f"  {path}  {path.stat().st_size / 1e6:.2f} MB")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
