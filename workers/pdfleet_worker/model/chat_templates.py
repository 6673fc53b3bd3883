"""Chat templates that take tools, in the two tool-call formats the server parses (server/tool_calls.py): ChatML with
Qwen2.5's <tool_call> blocks (what `pdfleet model init` writes) and Llama 3.1's JSON calls; and which format a model's
own template uses."""

from __future__ import annotations

HERMES = "hermes"  # Qwen2.5 (and Hermes 2/3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>
LLAMA3_JSON = "llama3_json"  # Llama 3.1/3.2: [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]

# ChatML, the Qwen2.5 way: tools described in the system turn, calls in <tool_call> blocks, results as
# <tool_response> blocks in a user turn.
CHATML_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    ' + \'<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": \''
    " + '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": \"'"
    " + call['function']['name'] + '\", \"arguments\": ' + (call['function']['arguments'] | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1's header tokens; tools go into the first user turn (its "JSON based tool calling"), calls are one
# JSON object after <|python_tag|>, results come back in `ipython` turns.
LLAMA31_TOOLS = (
    "{{- bos_token }}"
    "{%- set ns = namespace(tools_shown=false) %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if tools and message['role'] == 'user' and not ns.tools_shown %}"
    "{%- set ns.tools_shown = true %}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '"
    ' + \'that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": \''
    " + 'dictionary of argument name and its value}. Do not use variables.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}"
    "{%- endif %}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<|python_tag|>{\"name\": \"' + call['function']['name'] + '\", \"parameters\": '"
    " + (call['function']['arguments'] | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '<|eom_id|>' }}"
    "{%- else %}"
    "{{- (message['content'] or '') + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def tool_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model; None when it does not take tools at all."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return None
