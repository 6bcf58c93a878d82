"""End-to-end GRPO benchmark of Tunix on CPU (peer for another JAX RL trainer).

What it runs (all Tunix's own code paths, nothing in Tunix is patched):
  * model: tunix.models.qwen3.model.Qwen3, random init (seeded), fp32:
    4 layers, embed 256, MLP hidden 768, 4 query heads, 2 kv heads, head_dim 64,
    vocab 151936, tied embeddings, rope_theta 1e6.  Tunix zero-initialises the
    MLP kernels (it expects a checkpoint), so the script refills gate/up/down
    with seeded glorot-uniform values, the same initialiser Tunix uses for the
    attention Einsums; embeddings keep Tunix's normal(0.01) init.
  * LoRA: qwix.LoraProvider(rank 16, alpha 16) on
    q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj (the module_path
    Tunix's examples/tests use for Qwen/Llama), qwix.apply_lora_to_model with
    model.get_model_input() as in tunix/cli/utils/model.py.
  * RL: tunix.rl.rl_cluster.RLCluster(rollout_engine="vanilla") +
    tunix.rl.grpo.grpo_learner.GrpoLearner: 4 prompts/step, num_generations 8
    (32 rollouts/step), max 64 new tokens, temperature 1.0 (top_p 1.0, no
    top_k, i.e. plain categorical sampling), eos <|im_end|>, learning rate 1e-4
    (optax.adamw, other args default), num_iterations 1, beta 0.0.
    beta=0 is allowed: GRPO then skips the reference forward
    (ref_per_token_logps=None), and no reference model is passed to RLCluster.
    With num_iterations=1 no old-policy forward is run either.  Actor, rollout
    and reference share one mesh, so the rollout sampler uses the trained LoRA
    weights directly (no weight sync).
  * data: chat prompts rendered with the Qwen3 chat template string
    "<|im_start|>user\\nReverse the text: <w1> <w2><|im_end|>\\n<|im_start|>assistant\\n"
    (seeded word pairs); reward = fraction of the characters of the reversed
    text (as a multiset) found in the completion.  Deterministic, cheap.

Settings that differ from a naive setup (jax 0.10.2, CPU):
  * Mesh: RLCluster needs a mesh per role.  jax.make_mesh on jax 0.10 defaults
    to AxisType.Explicit, and the Qwen3 embedding gather then raises
    ShardingTypeError in the sampler.  Using Tunix's own
    tunix.utils.mesh.create_mesh((1, 1), ("fsdp", "tp")) (AxisType.Auto) on the
    single CPU device fixes it; the model is built with no mesh and RLCluster
    reshards it onto that 1-device mesh.  No other workaround was needed.
  * The dataset batches must be numpy arrays ({"prompts": np.array([...])}),
    not Python lists: Tunix repeats each batch with jax.tree.map(np.repeat),
    which would otherwise split the list into per-string leaves.
  * kv_cache_size = max_prompt_length + max_new_tokens (32 + 64 = 96), the
    smallest size the vanilla sampler accepts.  The vanilla sampler attends over
    the whole cache each decode step, so a larger cache (Tunix's CLI uses
    prompt + new + 256) makes rollout slower.
  * RolloutConfig.seed is left at None, as Tunix defaults; the vanilla sampler
    then uses PRNGKey(0) for every rollout call.

Timing: each RL (global) step is timed with wrappers around the learner's
own methods (the wrappers only read the clock and block on the LoRA params):
  step    = GrpoLearner._run_global_step (rollout + reward/advantage + train)
  rollout = RLCluster.generate (prefill + decode + detokenise, vanilla sampler)
  train   = RLCluster.update_actor (policy forward/backward + adamw update)
  other   = step - rollout - train (reward, advantage, batching, host copies)
Step 1 includes XLA compilation and is reported separately; the medians are
over steps 2..N.  Tunix's own perf metrics (perf v1: perf/global_step_time,
perf/sum/rollout_time, perf/sum/actor_train_time) are collected through an
external metrics logger and printed when present.

What the step time is made of (2-core CPU, measured separately with the same
shapes; median of steps 2..7 over 5 runs: 20.1-22.9 s/step; the first run on
a fresh VM gave 26.7):
  * rollout ~55%: tokenise + prefill of 32x32 prompt tokens ~1.4 s, then 63
    decode steps of ~165 ms.  Each decode step is ~50 ms for the tied
    [32,256]x[256,151936] LM head (greedy decoding costs only that; the 4 small
    layers are negligible) plus ~115 ms for jax.random.categorical over the
    full 151936 vocab (Gumbel noise for 32x151936 values per token).
  * train ~45%: one jitted Tunix train step (~8 s alone).  The policy forward
    builds [32, 96, 151936] fp32 logits (Tunix computes all 96 prompt+completion
    positions, then keeps the last 64), grpo_loss_fn also computes token
    entropy over the full logits as a metric, and the backward goes through
    the LM head to the LoRA adapters; AdamW over 0.31M LoRA params is
    negligible.
  * other (reward, advantages, batching) ~0.01 s.  About 1.8 of the 2 cores
    are busy; ~6-7 s/step of it is kernel time from ~2.2M minor page faults
    per step (XLA's multi-GB temporaries are freshly mapped each step).

Run:
  .peers/vt/bin/python scripts/peers/bench_tunix_grpo.py [--steps 7] [--tok .peers/qwen3-tok]
(from the repository root, after scripts/peers/README.md's set-up)
"""

import argparse
import collections
import contextlib
import os
import resource
import statistics
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from tunix.models.qwen3 import model as qwen3_lib  # noqa: E402
from tunix.perf import export as perf_export  # noqa: E402
from tunix.perf import metrics as perf_metrics  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner as grpo_lib  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.utils import mesh as mesh_lib  # noqa: E402

LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"
WORDS = ("abc", "def", "ghi", "jkl", "mno", "pqr", "stu", "vwx", "cat", "dog",
         "sun", "moon", "tree", "lake", "red", "blue")
TEMPLATE = "<|im_start|>user\nReverse the text: {}<|im_end|>\n<|im_start|>assistant\n"


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tok", default=".peers/qwen3-tok")
  p.add_argument("--steps", type=int, default=7, help="RL steps incl. the first (compile) step")
  p.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
  p.add_argument("--group", type=int, default=8, help="num_generations (group size)")
  p.add_argument("--max-new", type=int, default=64)
  p.add_argument("--max-prompt-len", type=int, default=32)
  p.add_argument("--kv-cache", type=int, default=0, help="0 = max_prompt_len + max_new")
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--beta", type=float, default=0.0)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-perf", action="store_true", help="disable Tunix perf-v1 metrics")
  return p.parse_args()


def build_model(seed):
  cfg = qwen3_lib.ModelConfig(
      num_layers=4, vocab_size=151936, embed_dim=256, hidden_dim=768,
      num_heads=4, head_dim=64, num_kv_heads=2, rope_theta=1_000_000,
      norm_eps=1e-6, use_tied_embedding=True,
      dtype=jnp.float32, param_dtype=jnp.float32)
  model = qwen3_lib.Qwen3(cfg, rngs=nnx.Rngs(params=seed))
  # Tunix zero-inits the MLP kernels (checkpoint expected); refill them, seeded.
  init = nnx.initializers.glorot_uniform()
  key = jax.random.PRNGKey(seed + 1)
  for layer in model.layers:
    for name in ("gate_proj", "up_proj", "down_proj"):
      key, sub = jax.random.split(key)
      k = getattr(layer.mlp, name).kernel
      k[...] = init(sub, k.shape, jnp.float32)
  lora = qwix.LoraProvider(module_path=LORA_MODULES, rank=16, alpha=16.0)
  model = qwix.apply_lora_to_model(model, lora, rngs=nnx.Rngs(seed + 2),
                                   **model.get_model_input())
  return cfg, model


def make_dataset(n_steps, n_prompts, seed):
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(n_steps):
    texts = [" ".join(rng.choice(WORDS, 2, replace=False)) for _ in range(n_prompts)]
    batches.append({
        "prompts": np.array([TEMPLATE.format(t) for t in texts]),
        "answer": np.array([t[::-1] for t in texts]),
    })
  return batches


def reverse_reward(prompts, completions, answer, **kwargs):
  """Fraction of the reversed text's characters (multiset) in the completion."""
  del prompts, kwargs
  out = []
  for c, a in zip(completions, answer, strict=True):
    want, have = collections.Counter(str(a)), collections.Counter(c)
    out.append(sum(min(n, have[ch]) for ch, n in want.items()) / max(1, len(str(a))))
  return out


def main():
  args = parse_args()
  # With beta=0 Tunix's perf export takes np.mean of an empty list of reference
  # spans (perf/mean/refer_inference_time = nan); silence that numpy warning.
  warnings.filterwarnings("ignore", message="Mean of empty slice")
  warnings.filterwarnings("ignore", message="invalid value encountered in scalar divide")
  t_setup = time.perf_counter()
  n_roll = args.prompts * args.group
  kv_cache = args.kv_cache or (args.max_prompt_len + args.max_new)
  print(f"jax {jax.__version__} devices={jax.devices()} cpu_count={os.cpu_count()}")

  cfg, model = build_model(args.seed)
  n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  n_base = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"model: Qwen3 L={cfg.num_layers} D={cfg.embed_dim} F={cfg.hidden_dim} "
        f"H={cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim} V={cfg.vocab_size} tied fp32; "
        f"base params {n_base/1e6:.2f}M, LoRA params {n_lora/1e6:.3f}M")

  tok = AutoTokenizer.from_pretrained(args.tok)
  data = make_dataset(args.steps, args.prompts, args.seed)
  plen = max(len(tok.encode(p)) for b in data for p in b["prompts"])
  assert plen <= args.max_prompt_len, (plen, args.max_prompt_len)

  mesh = mesh_lib.create_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.adamw(args.lr),
      eval_every_n_steps=10**9,
      max_steps=args.steps,
      perf_metrics_options=None if args.no_perf else perf_metrics.PerfMetricsOptions(
          enable_perf_v1=True, enable_trace_writer=False),
  )
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR,
                                       rl_cluster_lib.Role.REFERENCE,
                                       rl_cluster_lib.Role.ROLLOUT)},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=training_config,
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=args.max_new,
          max_prompt_length=args.max_prompt_len,
          kv_cache_size=kv_cache,
          temperature=args.temperature,
          top_p=1.0,
          top_k=None,
          eos_tokens=[tok.convert_tokens_to_ids("<|im_end|>")],
      ),
  )
  perf_config = None
  if not args.no_perf:
    perf_config = perf_metrics.PerfMetricsConfig(
        custom_export_fn=perf_export.PerfMetricsExport.from_cluster_config(cluster_config))
  cluster = rl_cluster_lib.RLCluster(
      actor=model, reference=None, tokenizer=tok,
      cluster_config=cluster_config, perf_config=perf_config)
  learner = grpo_lib.GrpoLearner(
      rl_cluster=cluster,
      algo_config=grpo_lib.GrpoConfig(
          num_generations=args.group, num_iterations=1, beta=args.beta),
      reward_fns=reverse_reward)

  # --- timing wrappers (clock + block only; Tunix code paths unchanged) ---
  def lora_state():
    return nnx.state(cluster.actor_trainer.model, nnx.LoRAParam)

  cur = {}
  steps = []

  orig_generate = cluster.generate
  def timed_generate(*a, **k):
    t = time.perf_counter()
    out = orig_generate(*a, **k)
    cur["rollout"] = cur.get("rollout", 0.0) + time.perf_counter() - t
    cur["gen_tokens"] = cur.get("gen_tokens", 0) + sum(len(x) for x in out.tokens)
    cur["rollouts"] = cur.get("rollouts", 0) + len(out.tokens)
    return out
  cluster.generate = timed_generate

  orig_update = cluster.update_actor
  def timed_update(*a, **k):
    t = time.perf_counter()
    r = orig_update(*a, **k)
    jax.block_until_ready(lora_state())
    cur["train"] = cur.get("train", 0.0) + time.perf_counter() - t
    return r
  cluster.update_actor = timed_update

  orig_step = learner._run_global_step
  def timed_step(*a, **k):
    cur.clear()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    r = orig_step(*a, **k)
    jax.block_until_ready(lora_state())
    rec = dict(cur, step=time.perf_counter() - t)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    rec.update(user=ru1.ru_utime - ru0.ru_utime, sys=ru1.ru_stime - ru0.ru_stime,
               minflt=ru1.ru_minflt - ru0.ru_minflt)
    rec["other"] = rec["step"] - rec.get("rollout", 0.0) - rec.get("train", 0.0)
    steps.append(rec)
    print(f"step {len(steps)}: {rec['step']:.2f} s (rollout {rec.get('rollout', 0):.2f}, "
          f"train {rec.get('train', 0):.2f}, other {rec['other']:.2f}), "
          f"{rec.get('rollouts', 0)} rollouts, {rec.get('gen_tokens', 0)} gen tokens; "
          f"cpu user {rec['user']:.1f} s sys {rec['sys']:.1f} s, "
          f"{rec['minflt']/1e6:.2f}M minor faults", flush=True)
    return r
  learner._run_global_step = timed_step

  tunix_metrics = collections.defaultdict(dict)
  def ext_logger(buf):
    for name, (vals, _) in buf.metrics.items():
      if name.startswith("perf/") or name.startswith("rewards/") or name.startswith("completions/"):
        with contextlib.suppress(TypeError, ValueError):
          tunix_metrics[buf.global_steps][name] = float(np.mean(np.asarray(vals, dtype=np.float64)))
  cluster.with_external_metrics_logger(ext_logger)

  print(f"setup {time.perf_counter() - t_setup:.1f} s; GRPO: {args.prompts} prompts x {args.group} "
        f"= {n_roll} rollouts/step, max_new {args.max_new}, prompt pad {args.max_prompt_len} "
        f"(longest {plen}), kv_cache {kv_cache}, lr {args.lr}, beta {args.beta}, "
        f"T {args.temperature}, {args.steps} steps", flush=True)
  t_train = time.perf_counter()
  learner.train(data)
  t_train = time.perf_counter() - t_train

  # ---------------------------- report ----------------------------
  assert len(steps) == args.steps, (len(steps), args.steps)
  rest = steps[1:]
  med = lambda key: statistics.median(s.get(key, 0.0) for s in rest)  # noqa: E731
  med_step, med_roll, med_train = med("step"), med("rollout"), med("train")
  med_other, med_user, med_sys = med("other"), med("user"), med("sys")
  med_tok = statistics.median(s["gen_tokens"] for s in rest)
  tok_s = statistics.median(s["gen_tokens"] / s["step"] for s in rest)
  roll_s = statistics.median(s["rollouts"] / s["step"] for s in rest)
  decode_tok_s = statistics.median(s["gen_tokens"] / s["rollout"] for s in rest)
  print(f"\ntrain() wall {t_train:.1f} s; first (compile) step {steps[0]['step']:.2f} s "
        f"(rollout {steps[0].get('rollout', 0):.2f}, train {steps[0].get('train', 0):.2f})")
  print(f"steps 2..{len(steps)} median: step {med_step:.3f} s; rollout {med_roll:.3f} s "
        f"({100*med_roll/med_step:.0f}%), train {med_train:.3f} s ({100*med_train/med_step:.0f}%), "
        f"other {med_other:.3f} s; cpu user {med_user:.1f} s + sys {med_sys:.1f} s per step "
        f"({(med_user + med_sys)/med_step:.2f} cores busy)")
  step_list = " ".join(f"{s['step']:.2f}" for s in steps)
  print(f"  step times: {step_list}")
  print(f"  median gen tokens/step {med_tok:.0f} (of max {n_roll * args.max_new}); "
        f"rollout-only decode {decode_tok_s:.1f} tok/s")
  if tunix_metrics:
    # Tunix buffers rollout metrics under the global step they were produced in
    # (0-based) and perf metrics after the step counter is incremented (1-based).
    nan = float("nan")
    print("Tunix's own metrics per RL step (perf v1 spans; rewards; completion length):")
    for i in range(1, len(steps) + 1):
      p, r = tunix_metrics.get(i, {}), tunix_metrics.get(i - 1, {})
      print(f"  step {i}: perf/global_step_time {p.get('perf/global_step_time', nan):.2f} "
            f"perf/sum/rollout_time {p.get('perf/sum/rollout_time', nan):.2f} "
            f"perf/sum/actor_train_time {p.get('perf/sum/actor_train_time', nan):.2f}; "
            f"reward mean {r.get('rewards/score/mean', nan):.3f}; "
            f"completion len {r.get('completions/mean_length', nan):.1f}")
  lora_b = [x for path, x in jax.tree_util.tree_leaves_with_path(lora_state())
            if "lora_b" in jax.tree_util.keystr(path)]
  print(f"sanity: weight sync needed {learner.should_sync_weights}; LoRA-B max|w| after "
        f"training {max(float(jnp.max(jnp.abs(x))) for x in lora_b):.2e} (zero at init)")
  print(f"tunix-grpo small: median {med_step:.2f} s/step, {roll_s:.2f} rollouts/s, "
        f"{tok_s:.1f} gen tok/s (steps {len(rest)})")


if __name__ == "__main__":
  main()
