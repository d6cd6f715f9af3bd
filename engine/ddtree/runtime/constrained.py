"""Constrained decoding (a grammar, a JSON schema) that stays lossless and keeps speculation.

The round's graph verifies the tree without any constraint; the host then checks each constrained row's
emitted tokens (`Constraint.validate`). A token the constraint allows is also what the constrained decoder
would have chosen there: at T = 0 the argmax over a subset that holds the global argmax is that argmax, and
at T > 0 a sample from the target's distribution that lands in the allowed set is a sample of that
distribution restricted to it (rejection sampling). At the first refused token the target's choice among
the allowed tokens replaces it, from the logits the round kept for that position, and the row's text ends
there (`Engine.override`). So the drafter's tokens are still accepted wherever the constraint agrees, the
round's graph is the unconstrained one, and rounds whose tokens all pass cost no extra host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .engine import Engine


class ConstraintError(RuntimeError):
    """A constraint that cannot go on (a grammar whose matcher failed): its request fails, the others run."""


class Constraint(Protocol):
    """What the engine needs from a constraint on one request's tokens (serving/grammar.py: llguidance).
    Each method may raise ConstraintError."""

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the current state, the constraint allows in a row."""
        ...

    def consume(self, tokens: list[int]) -> None:
        """Advance the state over `tokens` (all allowed)."""
        ...

    def allowed(self) -> Tensor:
        """The tokens allowed next, as a [vocab] bool tensor on the CPU (at least one is)."""
        ...


def constrain(
    engine: Engine, emitted: dict[int, list[int]] | list[list[int]], constraints: dict[int, Constraint]
) -> tuple[int, dict[int, str]]:
    """Make what the rows of `constraints` just emitted (their first token, or a round's tokens; `emitted`
    maps rows to them and is edited in place) what constrained decoding emits, and advance the constraints.
    One host sync for all rows that need a replacement, none when every token passes. Returns how many
    tokens were replaced, and why each failed constraint failed ({row: message}; its tokens are dropped)."""
    fixes: dict[int, tuple[int, Tensor]] = {}
    failed: dict[int, str] = {}
    for row, constraint in constraints.items():
        tokens = emitted[row]
        if not tokens:
            continue
        try:
            good = constraint.validate(tokens)
            constraint.consume(tokens[:good])
            if good < len(tokens):
                fixes[row] = (good, constraint.allowed())
        except ConstraintError as exc:
            failed[row], emitted[row] = str(exc), []
    if fixes:
        for row, token in engine.override(fixes).items():
            emitted[row] = emitted[row][: fixes[row][0]] + [token]
            try:
                constraints[row].consume([token])
            except ConstraintError as exc:
                failed[row], emitted[row] = str(exc), []
    return len(fixes), failed


class MinTokens:
    """vLLM's `min_tokens` as a constraint: the stop tokens are refused until `count` tokens have been
    generated, so the target's choice among the others replaces a stop token drafted or chosen too early
    (lossless as any constraint here: the target's distribution without its stop tokens)."""

    def __init__(self, count: int, stop_token_ids: tuple[int, ...], vocab_size: int):
        self.left, self.stop, self.vocab_size = count, frozenset(stop_token_ids), vocab_size

    def validate(self, tokens: list[int]) -> int:
        for i, token in enumerate(tokens[: self.left]):
            if token in self.stop:
                return i
        return len(tokens)

    def consume(self, tokens: list[int]) -> None:
        self.left = max(0, self.left - len(tokens))

    def allowed(self) -> Tensor:
        allowed = torch.ones(self.vocab_size, dtype=torch.bool)
        if self.left:  # (asked after min_tokens too, when another constraint refused a token)
            allowed[list(self.stop)] = False
        return allowed


class AllowedTokens:
    """vLLM's `allowed_token_ids` as a constraint: every token from that set (the stop tokens too only if
    it holds them)."""

    def __init__(self, token_ids: tuple[int, ...], vocab_size: int):
        self.ids = frozenset(token_ids)
        self.mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask[list(self.ids)] = True

    def validate(self, tokens: list[int]) -> int:
        return next((i for i, token in enumerate(tokens) if token not in self.ids), len(tokens))

    def consume(self, tokens: list[int]) -> None:
        pass

    def allowed(self) -> Tensor:
        return self.mask.clone()


class AllOf:
    """Constraints that all hold: a token passes when each allows it (the caller makes sure that some token
    always does)."""

    def __init__(self, *constraints: Constraint):
        self.constraints = constraints

    def validate(self, tokens: list[int]) -> int:
        good = len(tokens)
        for constraint in self.constraints:
            good = constraint.validate(tokens[:good])
        return good

    def consume(self, tokens: list[int]) -> None:
        for constraint in self.constraints:
            constraint.consume(tokens)

    def allowed(self) -> Tensor:
        allowed = self.constraints[0].allowed()
        for constraint in self.constraints[1:]:
            allowed &= constraint.allowed()
        return allowed
