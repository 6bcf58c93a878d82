"""jaxrl against a peer on the same work, in alternating runs (peer, jaxrl, peer, jaxrl, ...): each figure,
the machine's load when it was taken, and the median of the per-pair ratios.

This machine's absolute speed drifts from day to day and under other load, and not equally for every
program, so only ratios of runs taken back to back mean anything (scripts/peers/README.md). Each run is a
fresh process; a pair is one peer run and the jaxrl run after it (or the runs of each `--jaxrl` tree,
each compared with the peer run before them).

    python scripts/bench_peers.py train              # LoRA r16 train step, Qwen3-0.6B shape, 4 x 256, fp32
    python scripts/bench_peers.py rollout            # 8 requests x (64 prompt + 128 sampled), 0.6B shape, fp32
    python scripts/bench_peers.py rollout --cpu-devices 2   # ... the engine tensor-parallel over 2 CPU devices
    python scripts/bench_peers.py rl                 # one GRPO step end to end, the small Qwen3, synchronous
    python scripts/bench_peers.py rl --async-level 2 --oversampling 2   # ... at the seeds' defaults
    python scripts/bench_peers.py train --pairs 3 --json out.json
    python scripts/bench_peers.py train --jaxrl . ../jaxrl-f8ce3d1   # and an older commit's tree:
                                          # scripts/worktree_at.sh f8ce3d1 ../jaxrl-f8ce3d1

The pairs and what each side runs:
  train:   peers/bench_hf_train.py MODEL_06B 4 256 (transformers + peft)  vs  scripts/bench_model.py --train-only;
           tokens/s, ratio = jaxrl / peer (higher is better for jaxrl).
  rollout: peers/bench_hf.py MODEL_06B 8 64 128 (transformers generate)   vs  scripts/bench_rollout.py
           --concurrency 8: end-to-end tokens/s (prefill included), ratio = jaxrl / peer; jaxrl's decode step
           as a share of the memory-bandwidth limit that bench_rollout.py measures in the same process.
  rl:      peers/bench_tunix_grpo.py --steps 7 (Tunix GRPO)              vs  `jaxrl run` of peers/e2e_small.toml
           (7 steps): median step time over steps 2..7, ratio = jaxrl / peer (lower is better for jaxrl;
           the issue's goal is <= 1/3).

Set-up (once per machine): scripts/peers/README.md (the peers' models and the Tunix venv, in .peers/). Transformers,
peft and torch 2.13.0 CPU are in jaxrl's own venv, so the transformers peers run with this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / "scripts" / "peers"
MADE = REPO / ".peers"  # what scripts/peers/README.md's set-up makes (git-ignored)


def load() -> float:
    """The 1-minute load average (`uptime`'s first figure)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> str:
    """stdout + stderr of `cmd` (run in `cwd`); exits with its tail when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    return out


def grab(pattern: str, text: str, what: str) -> float:
    m = re.search(pattern, text)
    if not m:
        raise SystemExit(f"no {what} in the output ({pattern!r}):\n{text[-3000:]}")
    return float(m.group(1))


def train_peer(args) -> dict:
    peer = run([args.hf_python, str(args.peers / "bench_hf_train.py"), args.model_06b, "4", "256"], args.timeout)
    return {"tokens_per_s": grab(r"LoRA r16 B=4 T=256: ([\d.]+) tok/s", peer, "peer tokens/s")}


def tree_env(tree: Path) -> dict:
    """The environment that makes `tree`'s jaxrl the one imported (not the installed checkout's)."""
    return os.environ | {"PYTHONPATH": str(tree)}


def train_jaxrl(args, tree: Path) -> dict:
    ours = run([sys.executable, str(tree / "scripts" / "bench_model.py"), "--train-only"], args.timeout,
               env=tree_env(tree))
    return {"tokens_per_s": grab(r"LoRA train step \(RL loss, AdamW\):\s+([\d.]+) tokens/s", ours, "tokens/s")}


def rollout_peer(args) -> dict:
    peer = run([args.hf_python, str(args.peers / "bench_hf.py"), args.model_06b, "8", "64", "128"], args.timeout)
    return {"tokens_per_s": grab(r"N=128 [\w.]+: ([\d.]+) tok/s", peer, "peer tokens/s")}


def rollout_jaxrl(args, tree: Path) -> dict:
    ours = run([sys.executable, str(tree / "scripts" / "bench_rollout.py"), "--concurrency", "8",
                "--prompt", "64", "--tokens", "128",
                *(["--cpu-devices", str(args.cpu_devices)] if args.cpu_devices > 1 else [])],
               args.timeout, env=tree_env(tree))
    return {"tokens_per_s": grab(r"end to end\s+([\d.]+) tok/s", ours, "end-to-end tokens/s"),
            "decode_tokens_per_s": grab(r"\| decode\s+([\d.]+) tok/s", ours, "decode tokens/s"),
            "decode_share_of_limit": grab(r"ratio (\d+)%", ours, "ratio to the limit") / 100}


def rl_config(args, work: Path) -> Path:
    """peers/e2e_small.toml with this run's async settings and its runs under `work`."""
    text = (args.peers / "e2e_small.toml").read_text()
    text = re.sub(r"(?m)^max_async_level = .*$", f"max_async_level = {args.async_level}", text)
    text = re.sub(r"(?m)^oversampling_factor = .*$", f"oversampling_factor = {args.oversampling}", text)
    text = re.sub(r"(?m)^max_steps = .*$", f"max_steps = {args.steps}", text)
    text = re.sub(r'(?m)^model_path = .*$', f'model_path = "{args.model_small}"\noutput_dir = "{work / "runs"}"', text)
    if f"max_async_level = {args.async_level}" not in text or "output_dir" not in text:
        raise SystemExit(f"{args.peers / 'e2e_small.toml'} no longer has the lines this script edits")
    path = work / "e2e_small.toml"
    path.write_text(text)
    return path


def rl_peer(args) -> dict:
    peer = run([args.tunix_python, str(args.peers / "bench_tunix_grpo.py"), "--steps", str(args.steps),
                "--tok", args.tok], args.timeout)
    return {"step_s": grab(r"steps 2\.\.\d+ median: step ([\d.]+) s", peer, "Tunix median step"),
            "rollout_s": grab(r"median: step [\d.]+ s; rollout ([\d.]+) s", peer, "Tunix rollout"),
            "train_s": grab(r"\), train ([\d.]+) s", peer, "Tunix train")}


def rl_jaxrl(args, tree: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        work = Path(tmp)
        # from the run's own folder: `python -m` puts the working directory first on sys.path, before
        # PYTHONPATH, so run from a checkout it would import that checkout's jaxrl whatever `tree` is
        run([sys.executable, "-m", "jaxrl", "run", str(rl_config(args, work))], args.timeout, env=tree_env(tree),
            cwd=work)
        rows = [json.loads(line) for line in (work / "runs" / "e2e-small" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 2 and "time/step" in r]
    return {key.removeprefix("time/") + "_s": statistics.median(r[key] for r in rows)
            for key in ("time/step", "time/rollout", "time/train")}


# name -> (peer run, jaxrl run, the figure compared, whether higher is better)
PAIRS = {"train": (train_peer, train_jaxrl, "tokens_per_s", True),
         "rollout": (rollout_peer, rollout_jaxrl, "tokens_per_s", True),
         "rl": (rl_peer, rl_jaxrl, "step_s", False)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", choices=sorted(PAIRS))
    ap.add_argument("--pairs", type=int, default=2, help="alternating (peer, jaxrl) pairs; at least 2")
    ap.add_argument("--peers", type=Path, default=PEERS, help="the folder of the peer scripts")
    ap.add_argument("--jaxrl", type=Path, nargs="+", help="the jaxrl checkouts whose scripts and package run, "
                    "each after every peer run (default: this one; add an older commit's tree for before/after)")
    ap.add_argument("--hf-python", default=sys.executable, help="interpreter with torch, transformers, peft")
    ap.add_argument("--tunix-python", default=str(MADE / "vt" / "bin" / "python"), help="interpreter with google-tunix")
    ap.add_argument("--model-06b", default=str(MADE / "qwen3-0.6b-random"), help="make_model.py 0.6b's folder")
    ap.add_argument("--model-small", default=str(MADE / "qwen3-small"), help="make_model.py small's folder")
    ap.add_argument("--tok", default=str(MADE / "qwen3-tok"), help="make_tokenizer.py's folder")
    ap.add_argument("--steps", type=int, default=7, help="rl: RL steps per run on both sides (median of 2..)")
    ap.add_argument("--async-level", type=int, default=0, help="rl: jaxrl's max_async_level")
    ap.add_argument("--oversampling", type=float, default=1.0, help="rl: jaxrl's oversampling_factor")
    ap.add_argument("--cpu-devices", type=int, default=1, help="rollout: bench_rollout.py's --cpu-devices")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    if args.pairs < 2:
        ap.error("--pairs: at least 2 (a ratio that was seen once is not a measurement)")
    peer_fn, jaxrl_fn, key, higher_is_better = PAIRS[args.pair]
    trees = [t.resolve() for t in args.jaxrl] if args.jaxrl else [REPO]  # PYTHONPATH is read from a temp dir
    print(f"{args.pair}: {args.pairs} pairs, {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs; jaxrl "
          f"trees: {', '.join(map(str, trees))}", flush=True)
    pairs = []
    for i in range(args.pairs):
        before = load()
        peer = peer_fn(args)
        row = {"peer": peer, "load": [before, load()], "jaxrl": []}
        for tree in trees:
            ours = jaxrl_fn(args, tree)
            row["jaxrl"].append(ours | {"tree": str(tree), "ratio": ours[key] / peer[key]})
            row["load"].append(load())
        pairs.append(row)
        print(f"pair {i + 1}: peer {json.dumps(peer)} | "
              + " | ".join(f"jaxrl {json.dumps(o)}" for o in row["jaxrl"])
              + f" | load average {' -> '.join(f'{x:.1f}' for x in row['load'])}", flush=True)
    medians = []
    for j, tree in enumerate(trees):
        ratios = [p["jaxrl"][j]["ratio"] for p in pairs]
        med = statistics.median(ratios)
        medians.append(med)
        better = med if higher_is_better else 1 / med
        print(f"{args.pair} [{tree}]: median jaxrl/peer {key} = {med:.3f} (pairs: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}); jaxrl {better:.2f}x the peer's speed", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "pair": args.pair, "pairs": pairs,
                                               "median_ratios": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
