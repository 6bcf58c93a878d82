"""Step time of the quickstart with generation overlapping training (`max_async_level` 0, 1, 2).

Runs `configs/quickstart.toml` through `python -m jaxrl run` once per level, each in a fresh run folder
under a temporary directory, for `--steps` steps (the runs share a JAX compilation cache, so only the
first pays for compiling), and reads each run's metrics.jsonl. Over the steps after the first (step 1
compiles the train step): mean `time/step`, `time/rollout` (the time the trainer waited for its
rollouts), `time/train`, and `async/staleness_mean`. The overlap gained at level k is the speedup
`step(0) / step(k)` and the share of level 0's train time that level k hides,
`(step(0) - step(k)) / train(0)` (1.0: training entirely hidden behind generation).

`oversampling_factor` is 1 at every level unless `--oversampling F` (used at levels >= F), so the figures
isolate the overlap.

    python scripts/bench_async.py                     # levels 0 1 2, 10 steps each
    python scripts/bench_async.py --steps 15 --levels 0 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.toml"


def config_text(level: int, oversampling: float, steps: int, output_dir: Path) -> str:
    """The quickstart at `level`, `steps` steps, its runs under `output_dir`, the model path absolute."""
    text = QUICKSTART.read_text()
    model = (QUICKSTART.parent / "../assets/qwen3-tiny").resolve()
    factor = oversampling if level >= oversampling else 1.0
    text = text.replace('name = "quickstart"', f'name = "async{level}"')
    text = text.replace("max_steps = 15", f"max_steps = {steps}")
    text = text.replace("lora_alpha = 16",
                        f"lora_alpha = 16\nmax_async_level = {level}\noversampling_factor = {factor}")
    text = text.replace('model_path = "../assets/qwen3-tiny"', f'model_path = "{model}"\noutput_dir = "{output_dir}"')
    if f"max_async_level = {level}" not in text or str(model) not in text:
        raise SystemExit(f"{QUICKSTART} no longer has the lines this script edits; update config_text")
    return text


def run_level(level: int, oversampling: float, steps: int, work: Path, cache: Path) -> dict[str, float]:
    """Run the quickstart at `level`; the means over steps 2.. of its timing metrics."""
    cfg = work / f"async{level}.toml"
    cfg.write_text(config_text(level, oversampling, steps, work / "runs"))
    env = os.environ | {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxrl", "run", str(cfg)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"level {level} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (work / "runs" / f"async{level}" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 2]
    out = {k: statistics.mean(r[k] for r in rows) for k in
           ("time/step", "time/rollout", "time/train", "async/staleness_mean", "reward/mean")}
    return out | {"async/stale_dropped": sum(r["async/stale_dropped"] for r in rows), "wall_s": wall,
                  "oversampling_factor": oversampling if level >= oversampling else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--oversampling", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is left out)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        work = Path(tmp)
        for level in args.levels:
            results[level] = run_level(level, args.oversampling, args.steps, work, work / "jax-cache")
            print(f"level {level}: done in {results[level]['wall_s']:.0f}s", file=sys.stderr)
    base = results.get(0)
    print(f"quickstart, {args.steps} steps per level, means over steps 2..{args.steps}:")
    print(f"{'level':>5} {'factor':>6} {'step s':>7} {'wait s':>7} {'train s':>7} {'stale':>6} {'dropped':>7} "
          f"{'speedup':>7} {'hidden':>6} {'reward':>6}")
    for level, r in results.items():
        speedup = base["time/step"] / r["time/step"] if base else float("nan")
        hidden = (base["time/step"] - r["time/step"]) / base["time/train"] if base else float("nan")
        r |= {"speedup": speedup, "train_hidden": hidden}
        print(f"{level:>5} {r['oversampling_factor']:>6.1f} {r['time/step']:>7.2f} {r['time/rollout']:>7.2f} "
              f"{r['time/train']:>7.2f} {r['async/staleness_mean']:>6.2f} {r['async/stale_dropped']:>7.0f} "
              f"{speedup:>6.2f}x {hidden:>6.0%} {r['reward/mean']:>6.3f}")
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
