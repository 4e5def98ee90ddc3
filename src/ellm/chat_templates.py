"""Built-in chat templates for models whose files carry none.

Gemma GGUF files (llama.cpp's converter) store no `tokenizer.chat_template`. Gemma's turn
format is fixed and documented, so we ship it: each turn is
`<start_of_turn>{user|model}\\n{text}<end_of_turn>\\n` after a leading `<bos>`, the
assistant role is called "model", turns must alternate starting with the user, and as
Gemma has no system role a system message is written at the top of the first user turn,
followed by a blank line. Turn text is stripped of surrounding whitespace; system text
is not.
"""
from __future__ import annotations

GEMMA_TEMPLATE = """\
{#- Gemma: no system role, so the system text opens the first user turn. -#}
{%- set state = namespace(lead='', skip=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set sys = messages[0]['content'] -%}
    {%- set state.lead = (sys if sys is string else sys[0]['text']) ~ '\\n\\n' -%}
    {%- set state.skip = 1 -%}
{%- endif -%}
{{- bos_token -}}
{%- for turn in messages[state.skip:] -%}
    {%- if (turn['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Gemma expects turns to alternate user / assistant, starting with the user') -}}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if turn['role'] == 'assistant' else turn['role']) ~ '\\n' -}}
    {%- if loop.first -%}{{- state.lead -}}{%- endif -%}
    {%- set body = turn['content'] -%}
    {%- if body is string -%}
        {{- body | trim -}}
    {%- elif body is iterable -%}
        {%- for part in body -%}
            {%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}
            {%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('a Gemma turn needs text or a list of parts') -}}
    {%- endif -%}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""


def builtin_template(architecture: str | None) -> str | None:
    """The template to use for `architecture` (a GGUF `general.architecture` or a config.json
    `model_type`) when the model files hold none, or None if there is no standard one."""
    if architecture and architecture.lower().startswith("gemma"):
        return GEMMA_TEMPLATE
    return None
