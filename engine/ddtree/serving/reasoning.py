"""Reasoning in chat answers: what a thinking model writes between <think> and </think> becomes the
message's `reasoning_content` (the field of vLLM's and DeepSeek's APIs), the rest its `content`.

    think  (Qwen3, DeepSeek-R1, Kimi K2 Thinking)   <think>the reasoning</think>the answer

Reasoning is read only where the answer starts with it (after whitespace), or where the chat template
opened it: a generation prompt that ends with <think> (DeepSeek-R1's, Kimi K2 Thinking's) puts the answer
inside the reasoning from its first token. Reasoning the generation never closed (it ran out of tokens) is
all reasoning; a <think> later in the answer is content as written. Whitespace at either end of the
reasoning and at the start of the content goes.
"""

from __future__ import annotations

from .tools import _partial_marker

OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


def reasoning_parser(parser: str, tokenizer) -> bool:
    """Whether answers are split (`--reasoning-parser`): "think" yes, "none" no, "auto" when the chat
    template writes <think>."""
    if parser != "auto":
        return parser == "think"
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    return OPEN in template


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered generation prompt (its last characters suffice) leaves the answer inside <think>."""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Generated text in, in pieces as it streams; (REASONING | CONTENT, text) pieces out, in order.

    Text comes out once settled: an end that could begin a marker, and whitespace that could end the
    reasoning, wait for the next piece. How the text is cut into pieces does not change what comes out."""

    START, THINK_START, THINKING, ANSWER_START, ANSWER = "start", "think-start", "thinking", "answer-start", "answer"

    def __init__(self, opened: bool = False):
        self.text, self.pos = "", 0
        self.state = self.THINK_START if opened else self.START
        self.reasoned = opened  # whether any reasoning began (the message then has reasoning_content)

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        """The pieces that `piece` settles; `final` (the end of the generation) settles the rest."""
        self.text += piece
        out: list[tuple[str, str]] = []
        while self._step(out, final):
            pass
        return out

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _step(self, out: list[tuple[str, str]], final: bool) -> bool:
        """Settle what the current state can settle; True when it moved to another state (go on)."""
        rest = self.text[self.pos :]
        if self.state == self.START:  # is the answer's first non-space text <think>?
            head = rest.lstrip()
            if head.startswith(OPEN):
                self.pos = len(self.text) - len(head) + len(OPEN)
                self.state, self.reasoned = self.THINK_START, True
                return True
            if not final and OPEN.startswith(head):  # empty, or a prefix of <think>: wait
                return False
            self.state = self.ANSWER
            return True
        if self.state in (self.THINK_START, self.ANSWER_START):  # leading whitespace goes
            stripped = rest.lstrip()
            self.pos += len(rest) - len(stripped)
            if not stripped and not final:
                return False
            self.state = self.THINKING if self.state == self.THINK_START else self.ANSWER
            return True
        if self.state == self.THINKING:
            j = rest.find(CLOSE)
            if j >= 0:
                self._emit(out, REASONING, rest[:j].rstrip())
                self.pos += j + len(CLOSE)
                self.state = self.ANSWER_START
                return True
            if final:
                self._emit(out, REASONING, rest.rstrip())
                self.pos = len(self.text)
                return False
            settled = rest[: len(rest) - _partial_marker(rest, 0, (CLOSE,))].rstrip()
            self._emit(out, REASONING, settled)
            self.pos += len(settled)
            return False
        self._emit(out, CONTENT, rest)
        self.pos = len(self.text)
        return False


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole generation; reasoning is None when none began."""
    splitter = ReasoningSplitter(opened)
    pieces = splitter.feed(text, final=True)
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    return (reasoning if splitter.reasoned else None), "".join(t for kind, t in pieces if kind == CONTENT)
