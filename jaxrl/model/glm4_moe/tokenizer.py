"""GLM-4.5's chat format and special tokens, for the offline tiny `glm4_moe` model (`jaxrl.model.assets`).

GLM-4.5's own tokenizer (a 151,329-rank BPE) cannot be rebuilt offline, so the tiny GLM's tokenizer is a
stand-in: Qwen's byte-level BPE (`qwen.tiktoken`, as the tiny Qwen3's) with GLM-4.5's special tokens
appended from id 151643 (not at GLM's ids, 151329 and up). Its chat template renders GLM-4.5's format,
so the tiny model sees the prompts INTELLECT-3 sees, token ids aside. A real INTELLECT-3 / GLM-4.5
checkpoint brings its own tokenizer and template; nothing here is used for it.
"""

from __future__ import annotations

# GLM-4.5's special tokens in its id order, each with the `special` flag (dropped by
# `decode(..., skip_special_tokens=True)`): the turn and media markers are; the think, tool and argument
# markers stay in decoded text, as Qwen3's do.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    *((t, True) for t in (
        "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
        "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
        "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>",
        "<|end_of_transcription|>", "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    )),
    *((t, False) for t in (
        "/nothink", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    )),
)
FIRST_ID = 151_643  # the stand-in's first special id: right after Qwen's BPE ranks
IDS = {t: FIRST_ID + i for i, (t, _) in enumerate(SPECIAL_TOKENS)}

# GLM-4.5's generation defaults (its generation_config.json): a turn ends at <|endoftext|>, or where the
# model hands the turn on, at <|user|> or <|observation|> (a tool's result).
GENERATION_CONFIG = {
    "eos_token_id": [IDS["<|endoftext|>"], IDS["<|user|>"], IDS["<|observation|>"]],
    "pad_token_id": IDS["<|endoftext|>"],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
}

# GLM-4.5's chat format, written for this project. What it renders:
# - `[gMASK]<sop>` once, then `<|system|>\n{content}`, `<|user|>\n{content}`, `<|assistant|>...` per turn
#   (no end-of-turn marker: the next role token ends a turn);
# - with `tools`, a first system turn listing them as JSON in <tools></tools> and GLM's XML call format;
#   assistant `tool_calls` as `<tool_call>{name}\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n...
#   </tool_call>` (string values as they are, others as JSON); a run of `tool` messages as one
#   `<|observation|>` turn of `<tool_response>` blocks;
# - assistant turns open with `\n<think>{reasoning}</think>`: the reasoning (`reasoning_content`, or a
#   `<think>...</think>` prefix of the content) kept only for turns after the last user message, an empty
#   block before it;
# - `add_generation_prompt` appends `<|assistant|>`, then `\n<think></think>` when `enable_thinking=False`
#   (and every user message gets GLM's `/nothink` switch).
CHAT_TEMPLATE = r"""[gMASK]<sop>
{%- if tools %}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' }}
    {%- for tool in tools %}
        {{- (tool | tojson) + '\n' }}
    {%- endfor %}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within the following '
        'XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}'
        '</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- set nothink = enable_thinking is defined and enable_thinking is false %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {{- '<|system|>\n' + content }}
    {%- elif message.role == 'user' %}
        {{- '<|user|>\n' + content }}
        {%- if nothink and not content.endswith('/nothink') %}
            {{- '/nothink' }}
        {%- endif %}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|assistant|>' }}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '\n<think>' + reasoning.strip() + '</think>' }}
        {%- else %}
            {{- '\n<think></think>' }}
        {%- endif %}
        {%- if content.strip() %}
            {{- '\n' + content.strip() }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '\n<tool_call>' + call.name }}
            {%- set args = call.arguments if call.arguments is mapping else {} %}
            {%- for key, value in args.items() %}
                {{- '\n<arg_key>' + key + '</arg_key>\n<arg_value>' }}
                {{- value if value is string else (value | tojson) }}
                {{- '</arg_value>' }}
            {%- endfor %}
            {{- '\n</tool_call>' }}
        {%- endfor %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|observation|>' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
    {%- if nothink %}
        {{- '\n<think></think>' }}
    {%- endif %}
{%- endif %}
"""
