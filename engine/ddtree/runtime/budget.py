"""`--budget auto`: the budget of each round chosen for the running batch, from what the last rounds showed.

A DDTree of budget B lists its nodes best first, so the tree of every smaller budget b is its first b
nodes, and the sum of their path probabilities under the draft is the number of drafted tokens that tree
is expected to get accepted (`speculative.tree.expected_accepted`). Each drafting round therefore brings
back, in its one readout, a forecast per row for every candidate budget. The target agrees with the draft
less (or more) than the draft believes: per row, the ratio of accepted drafted tokens to the forecast at
the budget the round used calibrates the next forecasts (both smoothed over rounds).

Before a round on n rows the controller picks, among the budgets measured for the rows' graph (batch
bucket, attention span), the one with the most expected committed tokens per second:
    sum over rows of (1 + calibration x forecast(b))  /  (measured round time(b) + overhead)
with budget 0 (plain decoding) committing one token per row. The overhead is what every round costs
besides its graph, whatever the budget: the host's share (reading the result, the scheduler, delivering
tokens) and prefill chunks between rounds; it is the smoothed time between the starts of consecutive
rounds minus the measured time of the one before. On a small model it is a large part of a round, and
leaving it out would make plain decoding look cheaper than it is. Rows without a forecast yet (new requests)
take the mean of the others', or, when no row has one, the largest budget is run to get one. A batch that
keeps choosing budget 0 drafts nothing and so learns nothing: every `explore_every`-th such round runs
the smallest drafting budget instead. Everything here is host arithmetic on numbers the readout already
brought back; the round itself stays one graph and one sync.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class RowEstimate:
    forecast: list[float]  # smoothed expected accepted drafted tokens, per forecast budget
    accepted: float  # smoothed drafted tokens accepted (calibration numerator)
    predicted: float  # smoothed forecast at the budget used (calibration denominator)

    @property
    def calibration(self) -> float:
        return self.accepted / self.predicted if self.predicted > 0 else 1.0


@dataclass
class BudgetController:
    forecast_budgets: tuple[int, ...]  # the positive budgets each drafting round forecasts, ascending
    rows: int
    smoothing: float = 0.3  # weight of the newest round in the smoothed forecasts and calibration
    explore_every: int = 32
    # round seconds per (batch bucket, attention span) and budget, measured at start-up
    costs: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    estimates: list[RowEstimate | None] = field(init=False)
    rounds_without_draft: int = 0
    overhead: float = 0.0  # smoothed seconds per round outside its graph
    last_start: float | None = None  # when the last round started (perf_counter) and its measured time
    last_cost: float = 0.0

    def __post_init__(self) -> None:
        self.estimates = [None] * self.rows

    def reset(self, row: int) -> None:
        """A new request in `row`: nothing known about it yet."""
        self.estimates[row] = None

    def table(self, n: int, span: int) -> dict[int, float]:
        """The measured round times {budget: seconds} of the smallest measured batch bucket and span
        covering n rows and `span` slots (the graph a round on them replays); the largest when none does."""
        buckets = sorted({b for b, _ in self.costs})
        bucket = buckets[min(bisect.bisect_left(buckets, n), len(buckets) - 1)]
        spans = sorted(s for b, s in self.costs if b == bucket)
        return self.costs[(bucket, spans[min(bisect.bisect_left(spans, span), len(spans) - 1)])]

    def expected_tokens(self, rows: list[int], budget: int) -> float:
        """Committed tokens a round at `budget` is expected to bring the given rows."""
        if budget == 0:
            return float(len(rows))
        known = [e for r in rows if (e := self.estimates[r]) is not None]
        mean = [sum(e.forecast[i] for e in known) / len(known) for i in range(len(self.forecast_budgets))]
        i = self.forecast_budgets.index(budget)
        total = 0.0
        for r in rows:
            e = self.estimates[r]
            total += 1.0 + (e.calibration * e.forecast[i] if e is not None else mean[i])
        return total

    def round_started(self, now: float, n: int, span: int, budget: int) -> None:
        """A round at `budget` on rows [0, n) starts at `now`: the time since the last one started, less that
        one's measured time, updates the overhead. A gap far longer than a round (the server was idle) is
        not a round's overhead and is skipped."""
        if self.last_start is not None:
            period = now - self.last_start
            if period < 10 * (self.last_cost + self.overhead) + 0.01:
                sample = max(0.0, period - self.last_cost)
                self.overhead += self.smoothing * (sample - self.overhead)
        self.last_start, self.last_cost = now, self.table(n, span).get(budget, 0.0) if self.costs else 0.0

    def choose(self, n: int, span: int, rows: list[int]) -> int:
        """The budget of the next round on rows [0, n) attending over `span` slots; `rows` are the active
        ones among them."""
        table = self.table(n, span)
        drafting = sorted(b for b in table if b > 0)
        if not drafting:
            return 0
        if not any(self.estimates[r] is not None for r in rows):
            return drafting[-1]  # nothing known: the largest tree tells the most
        best = max(sorted(table), key=lambda b: self.expected_tokens(rows, b) / (table[b] + self.overhead))
        if best == 0:
            self.rounds_without_draft += 1
            if self.rounds_without_draft >= self.explore_every:
                self.rounds_without_draft = 0
                return drafting[0]
        else:
            self.rounds_without_draft = 0
        return best

    def observe(self, budget: int, rows: list[int], accepted: list[int], forecasts: list[list[float]]) -> None:
        """After a round at `budget`: each active row's committed tokens (bonus included) and, when the
        round drafted, its forecast per forecast budget."""
        if budget == 0:
            return
        a = self.smoothing
        i = self.forecast_budgets.index(budget)
        for row, got, forecast in zip(rows, accepted, forecasts):
            e = self.estimates[row]
            if e is None:
                self.estimates[row] = RowEstimate(list(forecast), got - 1.0, forecast[i])
                continue
            e.forecast = [(1 - a) * old + a * new for old, new in zip(e.forecast, forecast)]
            e.accepted = (1 - a) * e.accepted + a * (got - 1.0)
            e.predicted = (1 - a) * e.predicted + a * forecast[i]
