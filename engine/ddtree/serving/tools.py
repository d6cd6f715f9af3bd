"""Tool calling for /v1/chat/completions: the request's `tools` and `tool_choice`, and the tool calls parsed
back out of the generated text.

The chat template renders the tools into the prompt; the model answers with its own markup, which a format
below turns into OpenAI's `tool_calls`:

    hermes   (Hermes, Qwen2.5, Qwen3)  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    kimi_k2  (Kimi K2)                 <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                                       <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>

With "auto", nothing constrains the generation: a call whose markup or JSON is malformed stays content. With
"required" or a named `tool_choice`, a grammar in the model's markup (`tool_call_grammar`) makes the answer
nothing but calls of the rendered tools, with arguments that follow their `parameters` schemas.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .protocol import bad_request, get_bool

TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


# ---- the request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated `tools`, `tool_choice` and `parallel_tool_calls`."""

    tools: tuple[dict, ...] = ()
    choice: str = "none"  # none | auto | required | function (the one named in `function`)
    function: str | None = None
    parallel: bool = True

    @classmethod
    def from_body(cls, body: dict) -> ToolRequest:
        tools = body.get("tools")
        if tools is None:
            tools = []
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list of function tools", "tools")
        names: list[str] = []
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
            name = function.get("name")
            if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
                raise bad_request(f"tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", "tools")
            if name in names:
                raise bad_request(f"tools[{i}]: the function name '{name}' is used twice", "tools")
            if not isinstance(function.get("description", ""), str):
                raise bad_request(f"tools[{i}].function.description must be a string", "tools")
            if not isinstance(function.get("parameters", {}), dict):
                raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            names.append(name)
        parallel = get_bool(body, "parallel_tool_calls", True)
        choice = body.get("tool_choice")
        if choice is None:
            return cls(tuple(tools), "auto" if tools else "none", None, parallel)
        if isinstance(choice, str) and choice in TOOL_CHOICES:
            if choice == "required" and not tools:
                raise bad_request("'tool_choice' required needs 'tools'", "tool_choice")
            return cls(tuple(tools), choice, None, parallel)
        named = choice.get("function") if isinstance(choice, dict) else None
        if (
            not isinstance(choice, dict)
            or choice.get("type") != "function"
            or not isinstance(named, dict)
            or not isinstance(named.get("name"), str)
        ):
            raise bad_request(
                '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if named["name"] not in names:
            raise bad_request(
                f"'tool_choice' names the function '{named['name']}', which is not in 'tools'", "tool_choice"
            )
        return cls(tuple(tools), "function", named["name"], parallel)

    @property
    def rendered(self) -> list[dict] | None:
        """The tools the chat template renders: none for "none", only the named one for a named choice."""
        if self.choice == "none" or not self.tools:
            return None
        if self.choice == "function":
            return [t for t in self.tools if t["function"]["name"] == self.function]
        return list(self.tools)


# ---- the formats ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # generated text: anything
        return None
    return value if isinstance(value, dict) else None


def _arguments(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


def _hermes_call(body: str) -> ToolCall | None:
    """`{"name": "f", "arguments": {...}}` (arguments may be absent: no arguments)."""
    call = _json_object(body)
    if call is None or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], _arguments(arguments))


KIMI_CALL = re.compile(r"\s*((?:functions\.)?([\w\-]+):\d+)\s*<\|tool_call_argument_begin\|>(.*)", re.DOTALL)


def _kimi_k2_call(body: str) -> ToolCall | None:
    """`functions.f:0<|tool_call_argument_begin|>{...}`. The call's id is the model's own `functions.f:0`:
    Kimi's chat template writes it back into the history as it was generated."""
    match = KIMI_CALL.fullmatch(body)
    arguments = _json_object(match.group(3)) if match else None
    if match is None or arguments is None:
        return None
    return ToolCall(match.group(1), match.group(2), _arguments(arguments))


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: calls between `call_begin` and `call_end`, optionally inside a section."""

    name: str
    call_begin: str
    call_end: str
    parse_call: Callable[[str], ToolCall | None]  # the text between call_begin and call_end
    section_begin: str | None = None
    section_end: str | None = None

    @property
    def opener(self) -> str:
        """The marker that starts the tool calls."""
        return self.section_begin or self.call_begin

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.section_begin, self.call_begin, self.call_end, self.section_end) if m)


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _hermes_call),
    "kimi_k2": ToolCallFormat(
        "kimi_k2",
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        _kimi_k2_call,
        section_begin="<|tool_calls_section_begin|>",
        section_end="<|tool_calls_section_end|>",
    ),
}


# calls are JSON as chat templates and json.dumps write it: free whitespace would let a model pad them forever
AS_DUMPED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(fmt: ToolCallFormat, tools: ToolRequest) -> str | None:
    """The llguidance grammar (Lark) of "required" and a named `tool_choice`: the answer is one call (without
    parallel_tool_calls) or several of the rendered tools, in `fmt`'s markup, each call's arguments a JSON
    object that follows its tool's `parameters` schema. None for "auto" and "none": the model decides."""
    if tools.choice not in ("required", "function") or not tools.rendered:
        return None
    calls = tools.rendered
    names = [t["function"]["name"] for t in calls]
    schemas = [t["function"].get("parameters") or {"type": "object"} for t in calls]
    if fmt.name == "hermes":
        body = {
            "x-guidance": AS_DUMPED,
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": schema},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, schema in zip(names, schemas)
            ],
        }
        rules = [
            'start: call ("\\n" call)*' if tools.parallel else "start: call",
            'call: "<tool_call>\\n" body "\\n</tool_call>"',
            f"body: %json {json.dumps(body)}",
        ]
    else:  # kimi_k2: its markers are special tokens, named as such
        rules = [
            f"start: <|tool_calls_section_begin|> call{'+' if tools.parallel else ''} <|tool_calls_section_end|>",
            "call: " + " | ".join(f"call_{i}" for i in range(len(calls))),
        ]
        for i, (name, schema) in enumerate(zip(names, schemas)):
            rules.append(
                f'call_{i}: <|tool_call_begin|> "functions.{name}:" /[0-9]+/ <|tool_call_argument_begin|> '
                f"%json {json.dumps({**schema, 'x-guidance': AS_DUMPED})} <|tool_call_end|>"
            )
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark("\n".join(rules))


def tool_call_format(parser: str, tokenizer) -> ToolCallFormat | None:
    """The format of `--tool-call-parser` (None for "none"); "auto" looks for a format's opening marker in
    the chat template, then among the tokenizer's added tokens (None when neither has one)."""
    if parser != "auto":
        return FORMATS.get(parser)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    try:
        added = set(tokenizer.get_added_vocab())
    except Exception:  # noqa: BLE001 - tokenizers shipped as code may not list them
        added = set()
    for found_in in (lambda m: m in template, lambda m: m in added):
        for fmt in (FORMATS["kimi_k2"], FORMATS["hermes"]):
            if found_in(fmt.opener):
                return fmt
    return None


# ---- parsing ----------------------------------------------------------------------------------


def _partial_marker(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text[start:] that is a proper prefix of a marker (held back: the next
    text may complete the marker)."""
    held = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text) - start), held, -1):
            if text.endswith(marker[:k]):
                held = k
                break
    return held


class ToolCallSplitter:
    """Generated text in, in pieces as it streams; content and complete tool calls out, in order.

    Content comes out as soon as it is settled: up to its last non-space character and short of an end that
    could be the start of a marker (the next piece may complete it). From the opening marker on, each call
    is held until its end marker and then comes out whole, parsed; a call that does not parse comes out as
    content, as written. Whitespace next to a parsed call is dropped, and with `parallel` off every call after the
    first is. How the text is cut into pieces does not change what comes out."""

    TEXT, BETWEEN, CALL = "text", "between", "call"  # before the calls, between calls, inside one

    def __init__(self, fmt: ToolCallFormat, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.text, self.pos, self.state = "", 0, self.TEXT
        self.gap = ""  # whitespace before the markers of the call being read: kept if that call is malformed
        self.calls: list[ToolCall] = []

    def feed(self, piece: str, final: bool = False) -> list[str | ToolCall]:
        """The content and calls that `piece` settles; `final` (the end of the generation) settles the rest."""
        self.text += piece
        out: list[str | ToolCall] = []
        while self._step(out, final):
            pass
        return out

    def _emit(self, out: list[str | ToolCall], item: str | ToolCall) -> None:
        if isinstance(item, ToolCall):
            if self.parallel or not self.calls:
                self.calls.append(item)
                out.append(item)
        elif item:
            self.gap = ""
            if out and isinstance(out[-1], str):
                out[-1] += item
            else:
                out.append(item)

    def _content(self, out: list[str | ToolCall], final: bool, markers: tuple[str, ...]) -> None:
        """Settle the content from pos on where no marker begins; at the end, trailing whitespace goes
        only when there were calls."""
        rest = self.text[self.pos :]
        if final:
            self._emit(out, rest.rstrip() if self.calls or self.state == self.BETWEEN else rest)
            self.pos = len(self.text)
            return
        settled = rest[: len(rest) - _partial_marker(self.text, self.pos, markers)].rstrip()
        self._emit(out, settled)
        self.pos += len(settled)

    def _step(self, out: list[str | ToolCall], final: bool) -> bool:
        """Settle what the current state can settle; True when it moved to another state (go on)."""
        fmt, text, pos = self.fmt, self.text, self.pos
        if self.state == self.CALL:
            j = text.find(fmt.call_end, pos)
            if j < 0 and not final:
                return False
            closed = j >= 0
            body = text[pos:j] if closed else text[pos:]
            call = fmt.parse_call(body)
            if call is None:
                self._emit(out, self.gap + fmt.call_begin + body + (fmt.call_end if closed else ""))
            else:
                self.gap = ""
                self._emit(out, call)
            self.pos = j + len(fmt.call_end) if closed else len(text)
            self.state = self.BETWEEN
            return closed
        if self.state == self.TEXT:
            found = [(text.find(fmt.opener, pos), fmt.opener)]
        else:
            found = [(text.find(m, pos), m) for m in (fmt.call_begin, fmt.section_end) if m]
        found = [(j, m) for j, m in found if j >= 0]
        if not found:
            self._content(out, final, (fmt.opener,) if self.state == self.TEXT else fmt.markers)
            return False
        j, marker = min(found)
        content = text[pos:j].rstrip()
        self._emit(out, content)
        self.gap += text[pos + len(content) : j]
        self.pos = j + len(marker)
        if self.state == self.TEXT:
            self.state = self.BETWEEN if fmt.section_begin else self.CALL
        else:
            self.state = self.CALL if marker == fmt.call_begin else self.TEXT
        return True


def split_tool_calls(fmt: ToolCallFormat, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generation; content is None when there are calls and nothing else."""
    splitter = ToolCallSplitter(fmt, parallel)
    content = "".join(item for item in splitter.feed(text, final=True) if isinstance(item, str))
    return (content or None) if splitter.calls else content, splitter.calls


def tool_call_deltas(index: int, call: ToolCall) -> list[dict]:
    """A call as stream deltas, the way OpenAI streams it: index, id, type and name, then the arguments."""
    head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
