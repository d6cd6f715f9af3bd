"""Constrained decoding (runtime/constrained.py) on tiny random models: under a constraint, every method
emits what constrained plain decoding emits, token for token, with replacements inside accepted paths."""

import pytest
import torch

from ddtree.runtime.constrained import ConstraintError, constrain
from ddtree.runtime.engine import Engine, SamplingParams
from test_engine import OracleEngine

PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46]]
NEW_TOKENS = 40


class ResidueConstraint:
    """Allows token t after a text whose tokens sum to s when (t + s) % 5 is 2, 3 or 4: a state that depends
    on every earlier token, refusing about two tokens in five."""

    def __init__(self, vocab: int):
        self.vocab, self.state = vocab, 0

    def ok(self, state: int, token: int) -> bool:
        return (token + state) % 5 > 1

    def validate(self, tokens):
        state = self.state
        for k, t in enumerate(tokens):
            if not self.ok(state, t):
                return k
            state = (state + t) % 5
        return len(tokens)

    def consume(self, tokens):
        for t in tokens:
            assert self.ok(self.state, t), "consume() only gets allowed tokens"
            self.state = (self.state + t) % 5

    def allowed(self):
        return torch.tensor([self.ok(self.state, v) for v in range(self.vocab)])


def constrained_reference(target, prompt, n):
    """Greedy constrained decoding the plain way: a fresh prefill of the whole text per token, the argmax over
    the allowed tokens of its logits."""
    eng = Engine(target, None, "ar", max_batch_size=1, max_seq_len=128, logprobs=True)
    constraint, out = ResidueConstraint(target.config.vocab_size), []
    for _ in range(n):
        eng.add(0, prompt + out, SamplingParams(max_new_tokens=1))
        logits = eng.path_logits[0, 0].masked_fill(~constraint.allowed(), float("-inf"))
        out.append(int(logits.argmax()))
        constraint.consume(out[-1:])
    return out


def run_constrained(eng, prompts, n, params=None):
    """What the scheduler does: each row's first token and each round's tokens go through constrain()."""
    params = params or SamplingParams(max_new_tokens=n)
    vocab = eng.target.config.vocab_size
    constraints = {i: ResidueConstraint(vocab) for i in range(len(prompts))}
    out = {i: [eng.add(i, p, params)] for i, p in enumerate(prompts)}
    replaced, failed = constrain(eng, out, constraints)
    assert not failed
    texts = {i: list(t) for i, t in out.items()}
    cuts = 0  # replacements that dropped tokens the round had accepted after them
    while min(len(t) for t in texts.values()) < n:
        emitted = eng.step(len(prompts))
        before = {i: len(emitted[i]) for i in constraints}
        count, failed = constrain(eng, emitted, constraints)
        assert not failed
        replaced += count
        cuts += sum(len(emitted[i]) < before[i] for i in constraints)
        for i in constraints:
            texts[i].extend(emitted[i])
    return [texts[i][:n] for i in range(len(prompts))], replaced, cuts


@pytest.fixture(scope="module")
def reference(tiny_target):
    return [constrained_reference(tiny_target, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 32)])
def test_constrained_greedy_equals_constrained_plain_decoding(tiny_target, tiny_drafter, reference, method, budget):
    drafter = None if method == "ar" else tiny_drafter
    eng = Engine(tiny_target, drafter, method, budget, max_batch_size=3, max_seq_len=128, logprobs=True)
    texts, replaced, _ = run_constrained(eng, PROMPTS, NEW_TOKENS)
    assert texts == reference
    assert replaced > 0, "the constraint must refuse some of the target's choices"


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_replacements_inside_long_accepted_paths(tiny_target, tiny_drafter, reference, method, budget):
    """A drafter that mostly proposes the unconstrained greedy continuation: rounds accept long paths through
    tokens the constraint refuses, which end the path at their replacement."""
    free = Engine(tiny_target, None, "ar", max_batch_size=3, max_seq_len=128).generate(
        PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS)
    )
    full = [p + r.token_ids for p, r in zip(PROMPTS, free)]
    eng = OracleEngine(
        tiny_target, tiny_drafter, method, budget, max_batch_size=3, max_seq_len=128, logprobs=True, continuations=full
    )
    texts, _, cuts = run_constrained(eng, PROMPTS, NEW_TOKENS)
    assert texts == reference
    assert cuts > 0, "some replacement must drop tokens its round had accepted after it"


def test_constrained_sampling_emits_only_allowed_tokens_and_is_reproducible(tiny_target, tiny_drafter):
    def sample():
        eng = Engine(tiny_target, tiny_drafter, "ddtree", 8, max_batch_size=3, max_seq_len=128, logprobs=True)
        return run_constrained(eng, PROMPTS, 30, SamplingParams(max_new_tokens=30, temperature=1.0, seed=7))[0]

    texts = sample()
    for text in texts:
        ResidueConstraint(tiny_target.config.vocab_size).consume(text)  # asserts each token was allowed
    assert sample() == texts


class Broken(ResidueConstraint):
    def allowed(self):
        raise ConstraintError("no token is allowed")


def test_a_failed_constraint_drops_its_row_only(tiny_target):
    eng = Engine(tiny_target, None, "ar", max_batch_size=2, max_seq_len=64, logprobs=True)
    vocab = tiny_target.config.vocab_size
    params = SamplingParams(max_new_tokens=20)
    for row in (0, 1):
        eng.add(row, PROMPTS[row], params)
    constraints = {0: Broken(vocab), 1: ResidueConstraint(vocab)}
    for _ in range(10):  # until row 0's constraint refuses a token and needs allowed()
        emitted = eng.step(2)
        _, failed = constrain(eng, emitted, constraints)
        if failed:
            break
    assert failed == {0: "no token is allowed"} and emitted[0] == []
    assert emitted[1], "the other row keeps its tokens"


def test_override_needs_the_path_logits(tiny_target):
    eng = Engine(tiny_target, None, "ar", max_batch_size=1, max_seq_len=64)
    eng.add(0, PROMPTS[0], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="logprobs=True"):
        eng.override({0: (0, torch.ones(tiny_target.config.vocab_size, dtype=torch.bool))})
