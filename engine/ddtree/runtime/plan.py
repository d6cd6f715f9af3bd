"""Round plans: what a round on n rows runs, fixed per batch size when the Engine is built.

A budget is one number for every batch size or a budget per batch size, {max batch size: budget}
(`--budget 1:32,16:8`): a round on n rows takes the budget of the smallest listed batch size at or
above n, the last entry for larger batches. Budget 0 switches drafting off at those batch sizes (plain
decoding rounds, where speculation would not pay). `round_plans` turns a method, a budget and the
drafter's block into one `RoundPlan` per batch size 1..max_batch_size, once; the Engine's rounds, its
CUDA graphs, the smoke test and the scheduler's metrics all read those plans.

Budget `auto` (method ddtree) gives each batch size a few candidate plans (`auto_budgets`) instead of one;
a round runs the one ddtree.runtime.budget chooses for it. Its static plan, used where nothing is
chosen (the smoke test's references, a round before start-up measured the candidates), is the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import AUTO

Budget = int | dict[int, int] | str | None
AUTO_BUDGETS = (0, 8, 16, 32, 64)  # what `auto` chooses from
# above this many verified tokens per round (batch bucket x (budget + 1)) larger trees stop paying even
# on a small model (SmolLM2 on an H200 still gained from budget 16 at 64 rows, 1088 tokens): such budgets
# are not candidates, which also bounds the graphs captured
AUTO_VERIFY_TOKENS = 2048


def auto_budgets(n: int) -> tuple[int, ...]:
    """The budgets `auto` chooses from on n rows: budget 0, the smallest drafting budget, and the larger ones
    whose round on n rows' batch bucket (the next power of two) verifies at most AUTO_VERIFY_TOKENS tokens."""
    bucket = 1 << (n - 1).bit_length()
    return tuple(b for i, b in enumerate(AUTO_BUDGETS) if i < 2 or bucket * (b + 1) <= AUTO_VERIFY_TOKENS)


@dataclass(frozen=True)
class RoundPlan:
    """What a round on n rows runs. Row counts share a plan up to `batch`: the rounds on every row count
    from the previous plan's `batch` + 1 up to this one's are the same round, so a CUDA graph of batch
    bucket `batch` replays the eager round of each row count it covers."""

    batch: int  # the largest row count this plan covers (at most max_batch_size)
    drafts: bool  # a drafter forward proposes a tree (False: the root alone, plain decoding)
    budget: int  # DDTree node budget (dflash: block - 1; 0 for ar and when not drafting)
    tree_size: int  # target tokens verified per sequence (budget + 1 for ddtree)
    block: int  # drafter queries per sequence (its block size); 0 when not drafting


def check_budget(method: str, budget: Budget) -> tuple[list[tuple[int, int]] | None, int | None]:
    """Validate a budget: returns the budget per batch size as sorted (max batch size, budget) entries (None
    for one budget) and the largest budget (None: the method's default)."""
    if isinstance(budget, str):
        if budget != AUTO:
            raise ValueError(f"budget must be an integer, a budget per batch size or '{AUTO}', got {budget!r}")
        if method != "ddtree":
            raise ValueError(f"budget '{AUTO}' needs method 'ddtree' (got '{method}')")
        return None, max(AUTO_BUDGETS)
    if not isinstance(budget, dict):
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        return None, budget
    policy = sorted(budget.items())
    if method != "ddtree" or not policy:
        raise ValueError("a budget per batch size needs method 'ddtree' and at least one entry")
    if any(n < 1 or b < 0 for n, b in policy):
        raise ValueError(f"budget per batch size needs batch sizes >= 1 and budgets >= 0, got {budget}")
    return policy, max(b for _, b in policy)


def needs_drafter(method: str, budget: Budget) -> bool:
    """Whether an engine of `method` at `budget` keeps its drafter: not for `ar`, nor for `ddtree` when
    every budget is 0 (verifying the root only is plain decoding, with no drafter work)."""
    _, largest = check_budget(method, budget)
    return method == "dflash" or (method == "ddtree" and largest != 0)


def round_sizes(method: str, budget: int | None, block: int) -> tuple[int, int, int]:
    """(budget, max_depth, tree_size) of a `method` round at `budget` (None: block - 1) with a drafter block
    of `block` tokens (1 without a drafter): its node budget, its deepest accepted path and the target
    tokens it verifies per sequence."""
    if method == "ddtree":
        budget = block - 1 if budget is None else budget
        return budget, min(budget, block - 1), budget + 1
    if method == "dflash":
        return block - 1, block - 1, block
    return 0, 0, 1


def round_plans(method: str, budget: Budget, block: int, drafter: bool, max_batch_size: int) -> tuple[RoundPlan, ...]:
    """The plan of every batch size 1..max_batch_size (the plan of n rows at index n - 1), for `method` at
    `budget` (one, or one per batch size) with a drafter of block size `block` when `drafter` is set (an
    engine without one has block 1)."""
    policy, largest = check_budget(method, budget)
    if budget == AUTO:
        return tuple(candidate_plans(n, block, drafter, max_batch_size)[-1] for n in range(1, max_batch_size + 1))
    entries = policy or [(max_batch_size, largest)]
    plans = []
    for n in range(1, max_batch_size + 1):
        limit, b = next(((m, b) for m, b in entries if n <= m), (max_batch_size, entries[-1][1]))
        b, _, tree_size = round_sizes(method, b, block)
        drafts = drafter and b > 0
        plans.append(RoundPlan(min(limit, max_batch_size), drafts, b, tree_size, block if drafts else 0))
    return tuple(plans)


def candidate_plans(n: int, block: int, drafter: bool, max_batch_size: int) -> tuple[RoundPlan, ...]:
    """The plans `auto` chooses from on n rows, by ascending budget (one per budget of auto_budgets(n)); they
    cover n's batch bucket (the next power of two, at most max_batch_size)."""
    bucket = min(1 << (n - 1).bit_length(), max_batch_size)
    plans = []
    for b in auto_budgets(n):
        drafts = drafter and b > 0
        plans.append(RoundPlan(bucket, drafts, b, b + 1, block if drafts else 0))
    return tuple(plans)
