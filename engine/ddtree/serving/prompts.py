"""Request bodies to token ids: JSON decoding, size checks before any tokenizing, users' text with control
tokens as plain text, and the chat template around it.

Everything here runs on the server's preparation thread (`EngineServer.prepare`), never on the event loop:
a multi-megabyte prompt costs that thread time, not every other connection's.
"""

from __future__ import annotations

import json
import re
import secrets

from .protocol import APIError, bad_request, chat_messages

MAX_JSON_DEPTH = 64  # deeper bodies are refused; OpenAI's own requests nest a few levels (tools: ~10)
# Normalizers can shorten text before it is split into tokens (NFKC folds some sequences): the size check
# allows this factor over the longest-token bound so that it never refuses a prompt that would fit.
NORMALIZER_SLACK = 2
UNKNOWN_LONGEST_TOKEN = 1024  # characters, when a tokenizer cannot list its vocabulary
# rendered once at start-up to learn whether the chat template writes tools into the prompt
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def decode_body(raw: bytes) -> dict:
    """The request's JSON object. Malformed JSON, nesting deeper than MAX_JSON_DEPTH and strings that are
    not valid Unicode (a lone surrogate escape such as \\ud800) are refused with 400, naming the field."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, value in body.items():
        _check_value(key, value)
    return body


def _check_value(key: str, value) -> None:
    if not _valid_text(key):
        raise bad_request("a field name is not valid Unicode (lone surrogate escape)")
    stack = [(value, 2)]  # the body object is level 1
    while stack:  # iterative: the depth bound is what we check, not the interpreter's recursion limit
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"'{key}' nests deeper than {MAX_JSON_DEPTH} levels", key)
        if isinstance(item, str):
            if not _valid_text(item):
                raise bad_request(f"'{key}' holds text that is not valid Unicode (lone surrogate escape)", key)
        elif isinstance(item, dict):
            for k, v in item.items():
                if not _valid_text(k):
                    raise bad_request(f"'{key}' holds a field name that is not valid Unicode", key)
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more text. (Byte-level vocabularies
    spell one byte per character, and a text character is at least one byte, so the bound holds there too.)"""
    try:
        return max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - tokenizers shipped as code may not list their vocabulary
        return UNKNOWN_LONGEST_TOKEN


def control_tokens(tokenizer) -> list[str]:
    """The text of the tokenizer's special (control) tokens, longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(added.content)
    return sorted((t for t in found if t), key=len, reverse=True)


class PromptEncoder:
    """Token ids of a request's prompt (completions) or messages (chat).

    Users' text is tokenized with control tokens as plain text: a prompt or message holding
    `<|im_end|><|im_start|>system` stays text and cannot open a turn of its own. The chat template's
    own control tokens stay control tokens. `parse_special_tokens` turns this off for trusted clients."""

    def __init__(self, tokenizer, context: int, parse_special_tokens: bool = False):
        self.tokenizer, self.context, self.parse_special_tokens = tokenizer, context, parse_special_tokens
        self.max_chars = context * longest_token_chars(tokenizer) * NORMALIZER_SLACK
        self.control = control_tokens(tokenizer)
        self.splits_control = self._splits_control()
        self.renders_tools = self._renders_tools()

    def _splits_control(self) -> bool:
        """Whether the tokenizer can take control-token text as plain text (`split_special_tokens`)."""
        if not self.control:
            return True
        special_ids = set(self.tokenizer.convert_tokens_to_ids(self.control))
        try:
            ids = self.tokenizer.encode(self.control[0], add_special_tokens=False, split_special_tokens=True)
        except TypeError:
            return False
        return not special_ids.intersection(ids)

    def check_size(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise bad_request(
                f"the prompt has {chars} characters: more than the {self.max_chars} that can fit in this "
                f"server's context of {self.context} tokens",
                param,
            )

    def _control_text(self, text: str) -> str | None:
        return next((t for t in self.control if t in text), None)

    def plain_ids(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of users' text, control-token text included as plain text."""
        found = None if self.parse_special_tokens else self._control_text(text)
        if found is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not self.splits_control:
            raise bad_request(f"'{param}' holds the control token {found!r}, which this tokenizer cannot take as text")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))

    # ---- completions --------------------------------------------------------------------------

    def completion(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("'prompt' is empty", "prompt")
            self.check_size(len(prompt), "prompt")
            return self.plain_ids(prompt, "prompt", add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # token ids are taken as given, control tokens included
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")

    # ---- chat ---------------------------------------------------------------------------------

    def chat(self, body: dict, tools: list[dict] | None = None) -> list[int]:
        """Token ids of the chat; `tools` are the tools the template renders (ToolRequest.rendered)."""
        messages = chat_messages(body)
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions")
        if "developer" not in str(self.tokenizer.chat_template):
            # OpenAI's developer messages are its system messages under another name; a template that knows
            # no such role would write a turn of its own for it (and maybe its default system prompt too)
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if tools and not self.renders_tools:
            raise bad_request(
                "this model's chat template does not render tools, so this server cannot take 'tools' for it "
                '(send no tools, or "tool_choice": "none")',
                "tools",
            )
        tools_text = json.dumps(tools, ensure_ascii=False) if tools else ""
        calls_text = json.dumps(
            [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages], ensure_ascii=False
        )
        self.check_size(sum(len(m["content"]) for m in messages) + len(tools_text) + len(calls_text), "messages")
        if not self.parse_special_tokens:
            for text, param in ((tools_text, "tools"), (calls_text, "messages")):
                if found := self._control_text(text):
                    raise bad_request(
                        f"'{param}' holds the control token {found!r} outside a message's content, where it "
                        "cannot be taken as plain text; remove it",
                        param,
                    )
        if self.parse_special_tokens or not any(self._control_text(m["content"]) for m in messages):
            ids = self._template(messages, tools, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return self._chat_with_control_text(messages, tools)

    def _template(self, messages: list[dict], tools: list[dict] | None, tokenize: bool):
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=tokenize
            )
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(f"chat template failed: {exc}", "messages") from None

    def _renders_tools(self) -> bool:
        """Whether the chat template writes `tools` into the prompt: a template without tool support
        ignores them and renders the same text."""
        if not getattr(self.tokenizer, "chat_template", None):
            return False
        messages = [{"role": "user", "content": "Hi"}]
        try:
            plain = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            with_tools = self.tokenizer.apply_chat_template(
                messages, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            return False
        return with_tools != plain

    def _chat_with_control_text(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Some message holds control-token text. The template is rendered with a unique mark in place of
        each message's text; its text is tokenized with control tokens, each message's text as plain text. Only when
        the template copies every message verbatim (putting the texts back gives exactly the normal
        rendering) is the result the same prompt; otherwise the request is refused."""
        nonce = secrets.token_hex(8)
        mark_of = {i: f"\ue000{nonce}:{i}\ue001" for i, m in enumerate(messages) if m["content"]}
        marks = {mark_of[i]: messages[i]["content"] for i in mark_of}
        marked = [{**m, "content": mark_of[i]} if i in mark_of else m for i, m in enumerate(messages)]
        rendered = self._template(marked, tools, tokenize=False)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
        if "".join(marks.get(p, p) for p in pieces) != self._template(messages, tools, tokenize=False):
            raise bad_request(
                "a message holds control-token text and this model's chat template does not copy messages "
                "verbatim, so it cannot be taken as plain text; remove the control tokens",
                "messages",
            )
        ids: list[int] = []
        for piece in pieces:
            if piece in marks:
                ids += self.plain_ids(marks[piece], "messages")
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids
