"""The commented starter config `jaxrl init` writes: every required key set, every optional one shown
commented out at its default (a test checks it names every field of the schema and loads)."""

STARTER_TOML = '''\
# A training run: the Prime Hosted Training schema (`prime rl run` reads this file too) plus an
# optional [jax] table for local settings. Optional keys are shown commented out at their defaults.
# Check it with `jaxrl validate rl.toml`; start it with `jaxrl run rl.toml`.

model = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"  # HF model id, or a local folder
max_steps = 100                # training steps, one batch each
batch_size = 128               # rollouts per batch, a multiple of rollouts_per_example
rollouts_per_example = 8       # rollouts per example (the group size)

# name = "my-run"              # display name
# learning_rate = 1e-4         # LoRA learning rate
# lora_alpha = 16              # LoRA updates are scaled by lora_alpha / [jax] lora_rank
# env_file = ["secrets.env"]   # .env files with secrets, relative to this file
# checkpoint_id = "other-run/200"  # warm start from another run's LoRA: "run", "run/step" or a path
# trajectory_strategy = "interleaved"  # multi-turn: one sample per trace; "branching": one per turn
# oversampling_factor = 2.0    # rollouts in flight per batch_size rollouts
# max_async_level = 2          # policy versions a trained token may lag; >= oversampling_factor; 0: synchronous
# max_inflight_rollouts = 256  # rollouts in flight, instead of oversampling_factor
# env_files = ["more.env"]     # more .env files, read after env_file
# cluster_name = "..."         # Hosted Training only: accepted, no effect here (a note says so)
# run_config = {}              # Hosted Training only: accepted, no effect here

[sampling]
max_tokens = 512               # tokens sampled per turn, < [jax] seq_len
# temperature = 1.0            # >= 0; 0 = greedy
# top_p = 1.0                  # nucleus sampling; 1.0 = off (jaxrl only)
# top_k = -1                   # keep the k most likely tokens; -1 = off (jaxrl only)
# repetition_penalty = 1.0     # > 0; 1 = off
# min_tokens = 0               # tokens sampled before a stop token may end a turn (vLLM's)
# seed = 0                     # seed of rollout sampling; default: [jax] seed
# enable_thinking = false      # the chat template's thinking switch
# extra_body = {}              # Hosted Training only: accepted, no effect here
# reasoning_effort = "low"     # Hosted Training only: accepted, no effect here
# [sampling.temp_scheduler]    # training rollouts' temperature over steps (eval keeps temperature)
# type = "linear"              # or "cosine"
# start_temperature = 1.0      # at step 1
# end_temperature = 0.5        # from total_steps on
# total_steps = 100            # default: max_steps

[[env]]                        # one [[env]] table per training environment
id = "primeintellect/reverse-text"  # Environments Hub id: owner/name[@version]
# name = "reverse-text"        # display name
# args = { split = "train" }   # keyword arguments of load_environment()
# taskset = {}                 # verifiers v1 taskset table, passed to the environment as is
# harness = {}                 # verifiers v1 harness table, passed to the environment as is
# max_retries = 0              # times a failed rollout is played again
# version = "0.1.0"            # version the installed environment package must have

# [buffer]
# online_difficulty_filtering = false  # drop groups with all-equal rewards; sample by difficulty
# easy_threshold = 0.8         # latest mean reward >= this: easy
# hard_threshold = 0.2         # latest mean reward <= this: hard
# easy_fraction = 0.0          # share of easy examples still sampled
# hard_fraction = 0.0          # share of hard examples still sampled
# env_ratios = [0.5, 0.5]      # share of groups per [[env]] (multi-env only)
# skip_verification = false    # skip the pre-flight rollout of each env
# seed = 42                    # example order

# [eval]                       # online eval: eval/<env>/reward/mean, eval/<env>/pass@k, ...
# interval = 100               # evaluate after every N steps
# num_examples = -1            # examples of each env's eval split; -1 = all
# rollouts_per_example = 1
# eval_base_model = true       # also the untrained model, as step 0
# [[eval.env]]                 # default: the [[env]] environments
# id = "primeintellect/eval-env"
# args = { split = "test" }
# num_examples = 30            # overrides [eval]
# rollouts_per_example = 4     # overrides [eval]

# [val]                        # validation on the [[env]] eval splits: val/reward/mean, ...
# num_examples = 64            # per environment
# rollouts_per_example = 1
# interval = 5

# [wandb]                      # offline run in the run folder when WANDB_API_KEY is unset
# project = "my-project"
# entity = "my-team"
# name = "my-run-name"

# [checkpoints]
# interval = 10                # save every N steps (Hosted Training: cluster default)
# keep_cloud = 5               # checkpoints kept (-1 = all)

# [jax]                        # local settings; Hosted Training has no such table
# model_path = "path/to/hf-checkpoint"  # local HF folder, gs:// URL or HF id; default: `model`
# model_revision = "main"      # branch, tag or commit of an HF id to download (or model = "owner/name@rev")
# tokenizer_path = "path/to/tokenizer"  # default: the model folder
# mesh = { data = 1, fsdp = 1, tensor = 1, expert = 1 }  # device mesh; product = device count
# seq_len = 4096               # tokens per trajectory (prompt and completions)
# finetune = "lora"            # "lora" (adapters) or "full" (every weight: no lora_* keys, lr 1e-6 to 1e-5)
# lora_rank = 16
# lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# dtype = "float32"            # base weights: "float32" or "bfloat16"
# output_dir = "runs"          # metrics (and checkpoints) under <output_dir>/<name>; a local folder
# checkpoint_dir = "gs://bucket/ckpts"  # checkpoints under <checkpoint_dir>/<name>; folder or gs:// URL
# rollout_timeout = 600        # seconds per rollout; a slower one is dropped and counted as failed
# seed = 0
# decode_slots = 32            # concurrent decodes in the rollout engine
# kv_cache_tokens = 131072     # paged KV cache positions (>= seq_len); default: TPU/GPU what fits, CPU dense
# decode_steps_per_dispatch = 8  # decode steps per engine program (tokens read, weights swapped between them)
# kv_reuse_turns = false       # paged: a multi-turn rollout's next turn shares its last turn's pages (not bit-exact)
# remat = false                # recompute activations in the backward pass
# micro_batch_size = 64        # most sequences per train pass (gradients accumulated); default: largest that fits
# engine_hosts = 0             # hosts per rollout engine (multi-host); 0 = the fewest that fit (see jaxrl compile)
# host = "127.0.0.1"           # rollout server address
# port = 0                     # rollout server port; 0 = a free one

# [jax.loss]                   # the policy loss (docs/algorithms.md)
# type = "is"                  # "is" (prime-rl), "ppo" (PPO/GRPO clip), "gspo" (sequence ratio), "cispo"
# aggregation = "token_mean"   # "token_mean", "sequence_mean" (GRPO), "sequence_sum" (Dr.GRPO)
# aggregation_length = 512     # Dr.GRPO's constant; default [sampling] max_tokens, else [jax] seq_len
# mask_low = 0.125             # "is": tokens with a ratio outside [mask_low, mask_high] are masked
# mask_high = 8.0
# mismatch_kl_coef = 1e-3      # "is": weight of (log ratio)^2
# clip_low = 0.8               # "ppo"/"gspo"/"cispo": ratio clipped to [clip_low, clip_high]
# clip_high = 1.2              # DAPO's clip-higher: 1.28
# dual_clip = 3.0              # "ppo": cap of the loss at -dual_clip * A where A < 0; default off
# kl_coef = 0.0                # KL penalty to the reference (the base, LoRA off); reports policy/ref_kl
# kl_estimator = "k3"          # "k1", "k2" or "k3"
# teacher_tau = 0.0            # weight of the teacher's per-token advantage (distillation); needs [jax.teacher]
# adv_tau = 1.0                # weight of the reward advantage; 0 with teacher_tau > 0: pure distillation
# entropy_coef = 0.0           # entropy bonus

# [jax.advantage]              # rewards to advantages
# estimator = "mean"           # "mean" (r - group mean), "std" (GRPO), "rloo" (leave-one-out)
# reward_min = 0.0             # clip rewards below; default none
# reward_max = 1.0             # clip rewards above; default none
# batch_normalize = false      # normalise the batch's advantages to mean 0, std 1

# [jax.optim]                  # AdamW at learning_rate
# schedule = "constant"        # "constant", "linear" or "cosine" decay to 0 at max_steps
# warmup_steps = 0             # linear warmup, < max_steps
# weight_decay = 0.0
# beta1 = 0.9
# beta2 = 0.999
# max_grad_norm = 1.0          # clip the gradient's global norm

# [jax.teacher]                # on-policy distillation's teacher (README): a model, or a server
# model = "Qwen/Qwen3-4B"      # scored in process: HF folder, gs:// or Hub id; the student's tokenizer
# base_url = "http://127.0.0.1:8000/v1"  # or an OpenAI-compatible server (vLLM, jaxrl serve), not with model
# model_name = "Qwen/Qwen3-4B" # the server's model (with base_url)
# api_key_var = "TEACHER_KEY"  # environment variable with the server's API key
# max_concurrent = 8           # requests to the server at once
# timeout = 120.0              # seconds per request
# retries = 2                  # retries of a failed request; then the sample is dropped

# [jax.sft]                    # makes this a supervised fine-tuning config, for `jaxrl sft` (docs/sft.md)
# data = "sft.jsonl"           # chat JSONL: {"messages": [...]} or {"prompt": ..., "completion": ...} a line
# batch_size = 8               # packed rows of [jax] seq_len tokens per step
# seed = 0                     # packing and epoch order
# epochs = 2.0                 # passes over the data, in place of max_steps (not with it)

# [adapters]
# interval = 0                 # export every N steps; 0 = at the end only
# keep_last = 3                # -1 = all
#
# [infrastructure]
# compute_size = "M"           # CPU for the environments: "S", "M" or "L" (docs/config.md, "Resources")
#
# [tailscale]                  # Hosted Training only: accepted, no effect here
# enabled = false
# auth_key = "tskey-auth-..."
# hostname_prefix = "prime-hosted-training"
'''
