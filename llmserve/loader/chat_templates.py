"""Chat templates for GGUF files converted without one (``tokenizer.chat_template`` absent),
keyed by ``general.architecture``: the template the family's Hugging Face tokenizer ships.

Gemma's turns end with ``<end_of_turn>``; a chat request should stop on it
(``stop_token_ids``), as Gemma's generation_config does.
"""

from __future__ import annotations

# google/gemma-3 tokenizer_config.json's template, text parts only.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}
"""

# Gemma 1 and 2 take the same turns (their own templates refuse a system message instead).
DEFAULT_CHAT_TEMPLATES = dict.fromkeys(("gemma", "gemma2", "gemma3"), GEMMA_TEMPLATE)
