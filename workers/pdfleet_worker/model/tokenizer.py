"""Tokenizer (tokenizer.json via `tokenizers`), chat template and incremental detokenizer; LLMEngine and the server call
it."""

from __future__ import annotations

import json
import os
from typing import Any


class Tokenizer:
    """What the engine needs from a Hugging Face tokenizer directory, without transformers."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
        self._tok = HFTokenizer.from_file(path)
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict[str, Any] = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                self.config = json.load(f)
        self.chat_template: str | None = self.config.get("chat_template")
        tmpl_path = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(tmpl_path):
            with open(tmpl_path) as f:
                self.chat_template = f.read()
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render messages with the directory's Jinja chat template (the way transformers does: `tools` and any
        extra variables go to the template, `tojson` writes plain JSON)."""
        if not self.chat_template:
            raise ValueError("the model directory has no chat_template (tokenizer_config.json)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        # NOTE: Jinja's own tojson escapes HTML (<, >, &, ') and turns what it is joined with into escaped markup.
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template).render(
            **extra,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas. A delta is only released once it decodes to
    whole characters (byte-level tokens can split a UTF-8 sequence)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # NOTE: decoding restarts a few tokens back so merges across the boundary render right.
        self.prefix_offset = max(len(prompt_token_ids) - 5, 0)
        self.read_offset = len(prompt_token_ids)

    def step(self, all_token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        prefix = decode(all_token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(all_token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(all_token_ids)
            return full[len(prefix) :]
        return ""
