"""One engine for three methods: `ar` (plain decoding), `dflash` (verify the drafter's argmax chain, or a
DFlash2 drafter's selector chain) and `ddtree` (verify the top-B prefix tree). They share every step; only
the tree differs, and plain decoding is the root-only tree.

The engine owns `max_batch_size` rows (a batch row: one running request and its row of the KV caches).
A request joins a free row (`begin`), is prefilled eagerly in chunks (`prefill`, or all at once: `add`) and
leaves between rounds (`release`), so a scheduler can batch continuously and interleave a long prompt's
chunks with the running requests' rounds. A prefill forward runs at one of a few fixed token counts (up to
`prefill_chunk`: prefill_sizes) and attention spans (the graphs' span buckets), which `warm_up` runs once at
start-up, so that no request meets a kernel shape for the first time.

A round (`step`) runs on rows [0, n) under the round plan of n rows (plan.py: whether it drafts, its
budget and widths) and only reads and writes persistent per-row buffers, in place:
  draft   drafter appends the pending context features, runs [bonus, MASK...] -> D draft rows
  tree    root-only / chain / top-B tree, flattened to N = tree size nodes per sequence
  verify  one target forward over the N nodes: slots L..L+N-1, positions L + depth, ancestor mask
  walk    accept the longest path the target agrees with, plus its bonus token
  commit  compact the accepted KV rows to L..L+a-1, stage their tapped hidden states as drafter context
The host then reads one small tensor (accepted counts and emitted tokens): one sync per round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..models.llama import Transformer
from ..speculative.compat import method_problem
from ..speculative.dflash2 import DFlash2Drafter
from ..speculative.drafter import DFlashDrafter, DrafterMismatchError
from ..speculative.tree import Tree, build_chain, chain, expected_accepted, root_only
from ..speculative.verify import RowSampling, Walk, decide, processed_probs, tree_mask
from .budget import BudgetController
from .fused import greedy_reader, path_committer, tree_builder, tree_walker, use_backend, use_drafter_backend
from .graphs import default_span_buckets
from .pages import PAGE_SIZE, OutOfPages, PagePool
from .plan import (
    AUTO,
    AUTO_BUDGETS,
    RoundPlan,
    candidate_plans,
    check_budget,
    needs_drafter,
    round_plans,
    round_sizes,
)
from .round_profile import mark_phase

if TYPE_CHECKING:
    from .graphs import RoundGraphs

METHODS = ("ar", "dflash", "ddtree")
PREFILL_CHUNK = 2048  # the most prompt tokens one prefill forward takes (serving.prefill_chunk)
SMALLEST_PREFILL = 16


PREFILL_STEP = 128  # above this, prefill sizes grow by this much, not doubling: padding wastes < 128 tokens
FORECAST_SCALE = 1000  # forecasts travel in the integer readout as thousandths of a token


def prefill_sizes(largest: int) -> tuple[int, ...]:
    """The token counts a prefill forward runs at, so that prompts of every length meet the same few
    kernel shapes: powers of two from 16 to 128, then multiples of 128 up to `largest` (a chunk of r
    tokens is padded to the smallest that holds it)."""
    if largest < SMALLEST_PREFILL or largest & (largest - 1):
        raise ValueError(f"prefill chunk must be a power of two >= {SMALLEST_PREFILL}, got {largest}")
    sizes, size = [], SMALLEST_PREFILL
    while size <= largest:
        sizes.append(size)
        size = size * 2 if size < PREFILL_STEP else size + PREFILL_STEP
    return tuple(sizes)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Prefill:
    """A row's prompt while it is being prefilled, chunk by chunk."""

    prompt: list[int]
    params: SamplingParams
    done: int = 0  # prompt tokens already in the caches


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    rounds: int  # verify rounds after the prefill
    prompt_tokens: int
    elapsed_seconds: float
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Committed tokens per verify round, bonus included (1.0 for `ar`)."""
        return sum(self.accepted_per_round) / max(1, len(self.accepted_per_round))

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0


class Engine:
    def __init__(
        self,
        target: Transformer,
        drafter: DFlashDrafter | None = None,
        method: str = "ddtree",
        budget: int | dict[int, int] | str | None = None,
        max_batch_size: int = 1,
        max_seq_len: int = 2048,
        prefill_chunk: int = PREFILL_CHUNK,
        logprobs: bool = False,
        kv_cache_tokens: int | None = None,
    ):
        if method not in METHODS:
            raise ValueError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
        if method != "ar" and drafter is None:
            raise ValueError(f"method '{method}' needs a drafter")
        # a budget, or a budget per batch size ({max batch: budget}; 0 switches drafting off): plan.py
        _, largest = check_budget(method, budget)
        if drafter is not None:
            drafter.config.check_target(target.config)
        problem = method_problem(method, drafter.config.architecture) if drafter is not None else None
        if problem:
            raise DrafterMismatchError(problem)
        self.target, self.method = target, method
        # budget 0 everywhere verifies the root only: plain decoding, no drafter work
        self.drafter = drafter if needs_drafter(method, budget) else None
        block = self.drafter.block_size if self.drafter is not None else 1
        # buffers fit the largest budget; each batch size's round runs its own plan, self.plan(n)
        self.budget, self.max_depth, self.tree_size = round_sizes(method, largest, block)
        self.block_size = block
        self.plans = round_plans(method, budget, block, self.drafter is not None, max_batch_size)
        self.pinned: RoundPlan | None = None  # a plan every round runs, whatever its row count (pinned_plan)
        self.tap_layers = tuple(self.drafter.config.target_layer_ids) if self.drafter else ()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        # room past the committed text for the tree (target) and the block (drafter)
        self.room = max(self.tree_size, block)
        self.max_slots = max_seq_len + self.room
        self.prefill_sizes = prefill_sizes(prefill_chunk)
        self.span_buckets = default_span_buckets(self.max_slots)  # a prefill's attention spans
        self.prefills: dict[int, Prefill] = {}  # rows whose prompt is not all in the caches yet
        self.warm_up_seconds = 0.0
        if target.backend == "reference":  # a target straight from its family: fused GEMMs at least
            use_backend(target, "torch")
        self.build_ddtree = tree_builder(target.backend)  # the Triton heap or the tensorised build
        self.walk = tree_walker(target.backend)  # the accepted path: the tensorised walk or one Triton launch
        self.fused_commit = path_committer(target)  # commit_path in two Triton launches, or None
        self.read_greedy = greedy_reader(target.backend)  # the verify's argmax and root max, in one read
        # the caches' pages (runtime/pages.py): by default every row can hold max_seq_len tokens at once
        row_pages = -(-self.max_slots // PAGE_SIZE)
        pages = max_batch_size * row_pages if kv_cache_tokens is None else -(-kv_cache_tokens // PAGE_SIZE)
        self.page_pool = PagePool(pages)
        self.row_pages: list[list[int]] = [[] for _ in range(max_batch_size)]  # each row's pages, in order
        target.setup_caches(max_batch_size, self.max_slots, pages * PAGE_SIZE)
        self.slot_map = target.slot_map  # this engine's; another Engine on the same target replaces it
        self.device = dev = target.lm_head.weight.device
        # pad prefill chunks to the fixed sizes where kernels are compiled per shape (CUDA: Triton, CUDA
        # graphs, cuBLAS selection); on the CPU nothing is, and padding would only add work
        self.fixed_prefill_shapes = dev.type == "cuda"
        if self.drafter is not None:  # the drafter's context of a row sits at the target's slots of its text
            self.drafter.setup_caches(max_batch_size, self.max_slots, target.pool_slots, target.slot_map)
            use_drafter_backend(self.drafter, target.backend)  # the target's choice holds for both
        self.mask_token_id = self.drafter.config.mask_token_id if self.drafter else 0

        # persistent per-row state, written in place
        b = max_batch_size
        self.lengths = torch.zeros(b, dtype=torch.long, device=dev)  # committed tokens (= bonus position)
        self.bonus = torch.zeros(b, dtype=torch.long, device=dev)  # last emitted token, root of the next tree
        self.active = torch.zeros(b, dtype=torch.bool, device=dev)
        self.sampling = RowSampling.greedy(b, dev)
        feat = len(self.tap_layers) * target.config.hidden_size
        dtype = target.lm_head.weight.dtype
        # tapped target states of the last accepted path, not yet in the drafter cache
        self.ctx_features = torch.zeros(b, self.max_depth + 1, feat, dtype=dtype, device=dev)
        self.ctx_count = torch.zeros(b, dtype=torch.long, device=dev)
        # budget auto: each drafting round forecasts the acceptance of every drafting budget (runtime/budget.py)
        self.budgets: BudgetController | None = None
        forecast = tuple(x for x in AUTO_BUDGETS if x > 0) if budget == AUTO and self.drafter is not None else ()
        if forecast:
            self.budgets = BudgetController(forecast, max_batch_size)
        self.forecast_budgets = torch.tensor(forecast, dtype=torch.long, device=dev)
        # round output: [accepted, emitted tokens (max_depth + 1), forecasts (thousandths of a token)]
        self.readout = torch.zeros(b, self.max_depth + 2 + len(forecast), dtype=torch.long, device=dev)
        # each row's largest target logit at the root of its last round: what the smoke test compares between
        # graphs and eager (the root's alone: a pass over every node's logits would cost a read of them all)
        self.root_max_logit = torch.zeros(b, device=dev)
        # with logprobs: the target's logits at the nodes of the last accepted path (each emitted token's
        # distribution), copied in the round so that `token_logprobs` can read them after the sync
        vocab = target.config.vocab_size
        self.path_logits = torch.zeros(b, self.max_depth + 1, vocab, dtype=dtype, device=dev) if logprobs else None
        self.graphs: RoundGraphs | None = None  # once capture_graphs() ran
        # budget auto: the last round's forecasts per row, and their sum over its rows at the budget it ran
        self.last_forecasts: list[list[int]] = []
        self.last_forecast = 0.0
        self.last_plan: RoundPlan | None = None  # the plan of the last round step() ran
        self.eager_rounds = 0
        self.phase_events: list | None = None
        self.phase_markers: list[str] | None = None
        self.generator = torch.Generator(device=dev)
        # host mirrors, so that the host never reads the device outside the per-round readout
        self.host_lengths = [0] * b
        self.host_sampling = [False] * b
        self.host_active = [False] * b
        self.host_emitted = [0] * b  # tokens each row emitted in its last round (or prefill): override's cut
        # each active row's text (prompt and emitted tokens, the last one not yet in the caches): its full
        # pages are indexed for later prompts when the row is released (PagePool.publish)
        self.texts: list[list[int]] = [[] for _ in range(b)]

    # ---- joining and leaving ----------------------------------------------------------------

    @torch.inference_mode()
    def add(self, row: int, prompt: list[int], params: SamplingParams) -> int:
        """Prefill `prompt` into batch row `row` (eager, in chunks) and return its first token."""
        self.begin(row, prompt, params)
        first = self.prefill(row, len(prompt))
        assert first is not None
        return first

    def begin(self, row: int, prompt: list[int], params: SamplingParams, reuse: bool = False) -> int:
        """Claim row `row` for `prompt` (checked here: a ValueError refuses it) and the cache pages its
        prompt and a round past it can fill; each round takes the pages its row's text has grown into
        (grow). The row stays out of the rounds (inactive) until `prefill` has put the whole prompt in the
        caches.

        With reuse, the longest run of whole pages at the start of the prompt that the page index holds (a
        running request's prompt, a finished one's prompt and reply) is mapped into the row, not computed
        again. Returns the prompt tokens reused (whole pages, short of the last token, whose forward gives
        the first token). Raises OutOfPages when the pool cannot give the pages (pages_needed says first)."""
        self.check_request(prompt, params)
        self._own_caches()
        self.release(row)
        shared = self._claim(row, prompt, params, reuse)
        job = Prefill(list(prompt), params)
        self.prefills[row] = job
        if shared:
            job.done = shared
            self.lengths[row] = shared
            self.host_lengths[row] = shared
        return shared

    def _own_caches(self) -> None:
        """Set the models' caches up for this engine again when another Engine on the same models has set
        them up for itself since (tests and benchmarks build several on one model): what the rows held is
        gone, so every row starts empty."""
        if self.target.slot_map is self.slot_map:
            return
        for row in range(self.max_batch_size):
            self.prefills.pop(row, None)
            self.host_active[row] = False
            self.row_pages[row] = []
            self.release(row)
        self.page_pool = PagePool(self.page_pool.pages)
        self.target.setup_caches(self.max_batch_size, self.max_slots, self.page_pool.pages * PAGE_SIZE)
        self.slot_map = self.target.slot_map
        if self.drafter is not None:
            self.drafter.setup_caches(self.max_batch_size, self.max_slots, self.target.pool_slots, self.slot_map)

    def request_pages(self, prompt: list[int], params: SamplingParams) -> int:
        """Pages a request holds at its longest: its prompt and new tokens, and a round's tree or drafter
        block past them."""
        return self.page_pool.pages_for(len(prompt) + params.max_new_tokens + self.room)

    def start_pages(self, prompt: list[int]) -> int:
        """Pages a request takes at admission: its prompt and its first round's tree or block."""
        return self.page_pool.pages_for(len(prompt) + self.room)

    def _shared_pages(self, prompt: list[int]) -> list[int]:
        return self.page_pool.match(prompt[: len(prompt) - 1])

    def pages_needed(self, prompt: list[int], params: SamplingParams, reuse: bool = False) -> int:
        """Pages that begin() would take out of the available ones: new pages, and shared pages no row
        holds now (indexed, idle)."""
        shared = self._shared_pages(prompt) if reuse else []
        idle = sum(1 for page in shared if self.page_pool.refs[page] == 0)
        return self.start_pages(prompt) - len(shared) + idle

    def _claim(self, row: int, prompt: list[int], params: SamplingParams, reuse: bool) -> int:
        """Give row `row` its pages (shared ones first) and map its slots to them; returns the tokens shared."""
        pool = self.page_pool
        shared = self._shared_pages(prompt) if reuse else []
        pool.acquire(shared)
        try:
            fresh = pool.take(self.start_pages(prompt) - len(shared))
        except OutOfPages:
            pool.release(shared)
            raise
        self.row_pages[row] = shared + fresh
        self._map_pages(row)
        return len(shared) * PAGE_SIZE

    def pages_wanted(self, row: int) -> int:
        """Pages row `row` lacks for its next round: its committed text and a round's tree or drafter
        block past it."""
        return self.page_pool.pages_for(self.host_lengths[row] + self.room) - len(self.row_pages[row])

    def grow(self, row: int) -> bool:
        """Give row `row` the pages its next round can fill (pages_wanted). False, taking nothing, when
        the pool has too few available."""
        want = self.pages_wanted(row)
        if want <= 0:
            return True
        if want > self.page_pool.available:
            return False
        pages = self.row_pages[row]
        first = len(pages)
        pages += self.page_pool.take(want)
        self._map_pages(row, first)
        return True

    def _mapped_slots(self, row: int) -> int:
        """Logical slots of row `row` that its pages hold (the rest map to the trash slot)."""
        return min(len(self.row_pages[row]) * PAGE_SIZE, self.max_slots)

    def _map_pages(self, row: int, first: int = 0) -> None:
        """Point row `row`'s slot map (the target's, which the drafter shares) at its pages from page `first`
        on: logical slot s is slot s % PAGE_SIZE of page s // PAGE_SIZE. Slots past its pages, and the logical
        trash slot max_slots, stay at the trash slot (release puts them back), so that a row's map changes
        only where its pages do: one small copy per new page run, between rounds, queued without a host sync."""
        start, end = first * PAGE_SIZE, self._mapped_slots(row)
        if end <= start:
            return
        pages = torch.tensor(self.row_pages[row][first:], dtype=torch.int32)
        slots = (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, dtype=torch.int32)).flatten()[: end - start]
        dst = self.target.slot_map[row, start:end]
        if dst.is_cuda:  # from pageable memory the copy waits for the device: a host sync per new page
            slots = slots.pin_memory()
        dst.copy_(slots, non_blocking=dst.is_cuda)

    def cached_text(self, row: int) -> list[int]:
        """The tokens whose keys and values are in slots 0.. of row `row`'s target and drafter caches."""
        if self.host_active[row]:
            # the last round's path is staged for the drafter cache, not in it yet (ctx_count)
            staged = self.host_emitted[row] if self.drafter is not None else 0
            return self.texts[row][: self.host_lengths[row] - staged]
        job = self.prefills.get(row)
        return job.prompt[: job.done] if job is not None else []

    @torch.inference_mode()
    def prefill(self, row: int, budget: int) -> int | None:
        """Prefill up to `budget` more prompt tokens of row `row` (at least one chunk); return the first
        generated token once the whole prompt is in, else None.

        Between chunks the row takes part in rounds as an inactive row: its length is the prefilled count,
        and a round writes nothing into its caches (its tree and block go to the trash slot)."""
        job, budget, first = self.prefills[row], max(1, budget), None
        while first is None and budget > 0:
            take = min(len(job.prompt) - job.done, self.prefill_sizes[-1], budget)
            first = self.prefill_many([(row, take)])[0]
            budget -= take
        return first

    @torch.inference_mode()
    def prefill_many(self, takes: list[tuple[int, int]]) -> list[int | None]:
        """Prefill the next `take` prompt tokens (1 to one chunk, prefill_sizes[-1]) of each (row, take),
        several rows in one forward (_prefill_chunks); for each row, its first generated token if its whole
        prompt is now in the caches, else None."""
        chunks = []
        for row, take in takes:
            job = self.prefills[row]
            if not 0 < take <= min(self.prefill_sizes[-1], len(job.prompt) - job.done):
                raise ValueError(f"row {row}: cannot prefill {take} tokens ({len(job.prompt) - job.done} left)")
            chunks.append((row, job.prompt[job.done : job.done + take], job.done))
        hidden = self._prefill_chunks(chunks)
        firsts: list[int | None] = []
        for (row, take), last in zip(takes, hidden):
            job = self.prefills[row]
            job.done += take
            self.lengths[row] = job.done
            self.host_lengths[row] = job.done
            if job.done < len(job.prompt):
                firsts.append(None)
                continue
            del self.prefills[row]
            first = self._start([row], [len(job.prompt)], job.params, last[None])[0]
            self.texts[row] = job.prompt + [first]
            self.page_pool.publish(self.row_pages[row], job.prompt)  # its full pages, for prompts that start alike
            firsts.append(first)
        return firsts

    def prefill_span(self, start: int, tokens: int) -> int:
        """Cache slots a prefill chunk of `tokens` (padded) tokens at `start` attends over: a span bucket."""
        need = min(start + tokens, self.max_slots)
        return next(s for s in self.span_buckets if s >= need)

    def _padded(self, tokens: int) -> int:
        return next(s for s in self.prefill_sizes if s >= tokens)

    def prefill_rows(self, size: int) -> list[int]:
        """The batch rows a prefill forward of chunks of `size` (padded) tokens runs at on CUDA: powers of two
        up to the engine's rows, their tokens at most the largest chunk (prefill_batches)."""
        most = min(1 << (self.max_batch_size - 1).bit_length(), max(1, self.prefill_sizes[-1] // size))
        return [1 << i for i in range(most.bit_length()) if 1 << i <= most]

    def prefill_batches(self, sizes: list[int]) -> list[list[int]]:
        """Which chunks (of these token counts) share a prefill forward: on CUDA those of one padded size,
        as many as fill the largest chunk (rows x size), so that a forward meets the shapes warm_up ran;
        on the CPU, where nothing is compiled per shape, all of them."""
        if not self.fixed_prefill_shapes:
            return [list(range(len(sizes)))] if sizes else []
        batches: dict[int, list[list[int]]] = {}
        for i, n in enumerate(sizes):
            size = self._padded(n)
            groups = batches.setdefault(size, [[]])
            if len(groups[-1]) == self.prefill_rows(size)[-1]:
                groups.append([])
            groups[-1].append(i)
        return [group for size in sorted(batches) for group in batches[size]]

    def _prefill_chunks(self, chunks: list[tuple[int, list[int], int]]) -> list[Tensor]:
        """Prefill forwards of chunks (row, tokens, start): each puts `tokens` at positions start.. of its
        row; returns each chunk's last real token's hidden state. Chunks share a forward as prefill_batches
        says, right-padded to one size (a prefill size on CUDA) and, on CUDA, padded to a power of two rows
        by copies of the first whose writes go to the trash slot; no mask shows padding."""
        out: list[Tensor] = [None] * len(chunks)  # type: ignore[list-item]
        for batch in self.prefill_batches([len(tokens) for _, tokens, _ in chunks]):
            part = [chunks[i] for i in batch]
            longest = max(len(tokens) for _, tokens, _ in part)
            if self.fixed_prefill_shapes:
                size = self._padded(longest)
                rows = 1 << (len(part) - 1).bit_length()
                span = max(self.prefill_span(start, size) for _, _, start in part)
            else:
                size, rows = longest, len(part)
                span = max(start + len(tokens) for _, tokens, start in part)
            for i, hidden in zip(batch, self._prefill_forward(part, size, rows, span)):
                out[i] = hidden
        return out

    def _prefill_forward(self, part: list[tuple[int, list[int], int]], size: int, rows: int, span: int) -> list[Tensor]:
        """One forward of `rows` batch rows of `size` tokens over `span` cache slots: the chunks of `part`,
        then copies of the first that write nowhere."""
        dev = self.device
        fill = [part[0]] * (rows - len(part))
        tokens = torch.tensor([t + [0] * (size - len(t)) for _, t, _ in part + fill], device=dev)
        n = torch.tensor([len(t) for _, t, _ in part] + [0] * len(fill), device=dev)
        start = torch.tensor([s for _, _, s in part + fill], device=dev)
        index = torch.tensor([row for row, _, _ in part + fill], device=dev)
        j = torch.arange(size, device=dev)
        positions = start[:, None] + j
        real = j < n[:, None]  # [rows, size]: chunk tokens, not padding (none in the copies)
        slots = torch.where(real, positions, self.target.trash_slot)
        mask = (torch.arange(span, device=dev)[None, None, :] <= positions[:, :, None]).view(rows, 1, size, span)
        hidden, taps = self.target(tokens, positions, slots, mask, self.tap_layers, logits=False, rows=index)
        if self.drafter is not None:
            ctx_slots = torch.where(real, positions, self.drafter.max_slots)
            self.drafter.append_context(taps, positions, ctx_slots, rows=index)
        return [hidden[i, len(t) - 1] for i, (_, t, _) in enumerate(part)]

    def _start(self, rows: list[int], lengths: list[int], params: SamplingParams, last: Tensor) -> list[int]:
        """Activate prefilled rows (prompts of `lengths` tokens): their first tokens from each prompt's last
        hidden state, last [k, H]."""
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        index = torch.tensor(rows, device=self.device)
        self.lengths[index] = torch.tensor(lengths, device=self.device)
        self.ctx_count[index] = 0
        self.active[index] = True
        settings = self.sampling
        settings.temperature[index], settings.top_p[index] = params.temperature, params.top_p
        settings.top_k[index], settings.min_p[index] = params.top_k, params.min_p
        for row, n in zip(rows, lengths):
            self.host_lengths[row] = n
            self.host_sampling[row] = params.temperature > 0
            self.host_active[row] = True
            self.host_emitted[row] = 1
        logits = self.target.logits(last[:, None])
        if self.path_logits is not None:
            self.path_logits[index, 0] = logits[:, 0, : self.path_logits.shape[-1]]
        first = decide(logits, self.sampling[index], self.generator, params.temperature > 0)
        self.bonus[index] = first[:, 0]
        return first[:, 0].tolist()

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run every prefill shape a request can meet (each prefill size at each span bucket it reaches, and
        the first-token step greedy and sampling) once on row 0, so that kernels are compiled and selected
        at start-up, not in a request's time to first token. Must run while no request is active; returns
        the seconds it took."""
        start = time.perf_counter()
        for size in self.prefill_sizes:
            for span in self.span_buckets:
                at = max(0, span - size)
                real = min(size, self.max_seq_len - at)  # a chunk's tokens never pass the context
                if real > 0 and self._padded(real) == size and self.prefill_span(at, size) == span:
                    for rows in self.prefill_rows(size):
                        self._prefill_forward([(0, [0] * real, at)] * rows, size, rows, span)
        for temperature in (0.0, 1.0):
            self._start([0], [1], SamplingParams(temperature=temperature), self._prefill_chunks([(0, [0], 0)])[0][None])
        self.release(0)
        self.warm_up_seconds = time.perf_counter() - start
        return self.warm_up_seconds

    @torch.inference_mode()
    def add_many(self, rows: list[int], prompts: list[list[int]], params: SamplingParams) -> list[int]:
        """Prefill prompts[i] into batch row rows[i], all in one eager forward (right-padded to the longest
        prompt; padding writes go to the trash slot and no mask shows them), and return their first tokens:
        what add() gives for each. `params` holds for every prompt."""
        for prompt in prompts:
            self.check_request(prompt, params)
        self._own_caches()
        for row, prompt in zip(rows, prompts):
            self.release(row)
            self._claim(row, prompt, params, reuse=False)
        dev, longest = self.device, max(len(p) for p in prompts)
        tokens = torch.tensor([p + [0] * (longest - len(p)) for p in prompts], device=dev)
        n = torch.tensor([len(p) for p in prompts], device=dev)
        index = torch.tensor(rows, device=dev)
        j = torch.arange(longest, device=dev)
        real = j < n[:, None]  # [k, longest]: prompt tokens, not padding
        positions = j.expand(len(prompts), longest)
        mask = ((j[:, None] >= j[None, :]) & real[:, None, :]).view(len(prompts), 1, longest, longest)
        slots = torch.where(real, j, self.target.trash_slot)
        hidden, taps = self.target(tokens, positions, slots, mask, self.tap_layers, logits=False, rows=index)
        if self.drafter is not None:
            ctx_slots = torch.where(real, j, self.drafter.max_slots)
            self.drafter.append_context(taps, positions, ctx_slots, rows=index)
        last = hidden[torch.arange(len(prompts), device=dev), n - 1]  # each prompt's last token
        firsts = self._start(rows, [len(p) for p in prompts], params, last)
        for row, prompt, first in zip(rows, prompts, firsts):
            self.texts[row] = list(prompt) + [first]
            self.page_pool.publish(self.row_pages[row], prompt)
        return firsts

    def token_logprobs(self, row: int, tokens: list[int], top: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
        """Log-probabilities, under the target's distribution (before temperature and top-p), of the tokens
        row `row` emitted in its last round (or its first token, right after the prefill), each with the
        `top` most likely tokens and theirs. Needs an engine made with logprobs=True."""
        if self.path_logits is None:
            raise ValueError("this engine keeps no log-probabilities (made without logprobs)")
        logprobs = self.path_logits[row, : len(tokens)].float().log_softmax(-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=self.device)[:, None])[:, 0].tolist()
        if not top:
            return [(lp, []) for lp in chosen]
        values, ids = logprobs.topk(top, dim=-1)
        return [(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]

    def release(self, row: int) -> None:
        """Take row `row` out of the rounds and give back its pages; the full pages of what they hold
        (cached_text) stay indexed for begin(reuse=True) until the pool needs them."""
        if self.row_pages[row]:
            self.page_pool.publish(self.row_pages[row], self.cached_text(row))
            self.page_pool.release(self.row_pages[row])
            self.target.slot_map[row, : self._mapped_slots(row)].fill_(self.target.pool_slots)
            self.row_pages[row] = []
        self.texts[row] = []
        self.prefills.pop(row, None)
        if self.budgets is not None:
            self.budgets.reset(row)
        self.active[row] = False
        self.lengths[row] = 0  # idle rows stay at length 0, inside every attention span
        self.host_sampling[row] = False
        self.host_active[row] = False
        self.host_lengths[row] = 0

    # ---- one round --------------------------------------------------------------------------

    def plan(self, n: int) -> RoundPlan:
        """The round plan of n rows: whether the round drafts, its budget, tree size and drafter block."""
        if not 1 <= n <= self.max_batch_size:
            raise ValueError(f"no round on {n} rows: this engine has 1 to {self.max_batch_size}")
        return self.pinned or self.plans[n - 1]

    def candidates(self, n: int) -> tuple[RoundPlan, ...]:
        """The plans a round on n rows may run: the budget auto candidates, or its one plan."""
        if self.budgets is None:
            return (self.plans[n - 1],)
        return candidate_plans(n, self.block_size, True, self.max_batch_size)

    @contextmanager
    def pinned_plan(self, plan: RoundPlan) -> Iterator[None]:
        """Run every round under `plan` (one of this engine's plans), whatever its row count, until the block
        ends: the smoke test's eager references run each prompt alone under the plan of the batch they
        check, and graph capture runs each candidate of budget auto."""
        pinned = self.pinned
        self.pinned = replace(plan, batch=self.max_batch_size)
        try:
            yield
        finally:
            self.pinned = pinned

    def span_needed(self, n: int) -> int:
        """Cache slots a round on rows [0, n) attends over: the longest text plus the tree or block."""
        return max(self.host_lengths[:n]) + max(self.tree_size, self.block_size)

    def pending_context(self, n: int) -> tuple[Tensor, Tensor]:
        """Positions and drafter cache slots [n, D + 1] of the staged context features (the last round's
        accepted path, not yet in the drafter cache); positions past the staged count and idle rows get the
        trash slot."""
        lengths, count = self.lengths[:n], self.ctx_count[:n]
        j = torch.arange(self.ctx_features.shape[1], device=self.device)
        ctx_pos = lengths[:, None] - count[:, None] + j
        live = (j < count[:, None]) & self.active[:n, None]
        return ctx_pos.clamp(min=0), torch.where(live, ctx_pos, self.drafter.max_slots)

    def draft_depth(self, n: int) -> int:
        """Rows of draft logits a round on n rows uses: a tree of B nodes is at most B deep, so under a
        budget per batch size a plan's smaller budget needs only its first B rows through the LM head and
        the tree's top-k (budget auto builds the largest tree, whose forecast covers every candidate)."""
        if self.method != "ddtree" or self.budgets is not None:
            return self.max_depth
        return min(self.plan(n).budget, self.max_depth)

    def draft_states(self, n: int, span: int, depth: int) -> Tensor:
        """Drafter forward on rows [0, n): its hidden states [n, depth, H] at the first `depth` positions
        after the bonus (the block itself is always whole: its positions attend to each other)."""
        dev, block = self.device, self.block_size
        lengths = self.lengths[:n]
        block_tokens = torch.full((n, block), self.mask_token_id, dtype=torch.long, device=dev)
        block_tokens[:, 0] = self.bonus[:n]
        block_pos = lengths[:, None] + torch.arange(block, device=dev)
        block_slots = torch.where(self.active[:n, None], block_pos, self.drafter.max_slots)  # round(): trash
        ctx_pos, ctx_slots = self.pending_context(n)
        mask = (torch.arange(span, device=dev) < (lengths[:, None] + block)).view(n, 1, 1, span)
        hidden = self.drafter(
            self.target.embed(block_tokens),
            block_pos,
            block_slots,
            mask.expand(n, 1, block, span),
            self.ctx_features[:n],
            ctx_pos,
            ctx_slots,
        )
        return hidden[:, 1 : 1 + depth]

    def propose(self, n: int, span: int) -> Tensor:
        """Drafter forward on rows [0, n): [n, D, V] draft logits for the D = draft_depth(n) positions
        after the bonus."""
        return self.drafter.draft_logits(self.draft_states(n, span, self.draft_depth(n)), self.target.logits)

    def propose_chain(self, n: int, span: int) -> Tensor:
        """A DFlash2 drafter's chain on rows [0, n): [n, D] tokens its candidate selector picks left to right
        from the bonus. The same chain at T > 0: verification samples the target at every node and accepts
        a draft token that equals the sample, which needs no draft probabilities to be lossless."""
        drafter = self.drafter
        assert isinstance(drafter, DFlash2Drafter)
        hidden = self.draft_states(n, span, self.max_depth)
        logits = drafter.draft_logits(hidden, self.target.logits)
        return drafter.select(hidden, logits, self.bonus[:n]).tokens

    def build_tree(self, n: int, span: int) -> Tree:
        plan = self.plan(n)
        if not plan.drafts:
            if self.drafter is None:
                return root_only(self.bonus[:n])
            # speculation off at this batch size (budget 0): no draft, but the staged context (one token:
            # step() wrote a drafting round's longer path already) still goes into the drafter cache, so
            # that drafting resumes with the whole text when the batch shrinks
            ctx_pos, ctx_slots = self.pending_context(n)
            self.drafter.append_context(self.ctx_features[:n, :1], ctx_pos[:, :1], ctx_slots[:, :1])
            return root_only(self.bonus[:n])
        if isinstance(self.drafter, DFlash2Drafter):  # method dflash (__init__ refuses ddtree)
            drafts = self.propose_chain(n, span)
            self._mark("draft")
            return chain(self.bonus[:n], drafts)
        draft_logits = self.propose(n, span)
        self._mark("draft")
        if self.method == "dflash":
            return build_chain(self.bonus[:n], draft_logits)
        if self.budgets is None:
            return self.build_ddtree(self.bonus[:n], draft_logits, plan.budget)
        # budget auto: the largest tree, whose first nodes are the tree of each smaller budget, forecasts them all
        tree = self.build_ddtree(self.bonus[:n], draft_logits, self.budget)
        forecast = expected_accepted(tree.scores, self.forecast_budgets) * FORECAST_SCALE
        self.readout[:n, self.max_depth + 2 :].copy_(forecast.round())
        return tree.prefix(plan.budget + 1)

    def round(self, n: int, span: int, sampling: bool) -> None:
        """One draft-tree-verify-walk-commit round on rows [0, n), attending over `span` cache slots.

        Reads and writes only persistent buffers (results land in self.readout[:n]) and never syncs
        with the host, so that it can be captured as one CUDA graph per (n, span, sampling)."""
        dev = self.device
        self._mark("start")
        lengths, active = self.lengths[:n], self.active[:n]
        tree = self.build_tree(n, span)
        self._mark("tree")
        # inactive rows (idle, or between prefill chunks) write their tree to the trash slot: their caches
        # keep what prefix reuse and the next prefill chunk expect
        live = active[:, None]
        slots = torch.where(live, lengths[:, None] + torch.arange(tree.size, device=dev), self.target.trash_slot)
        mask = tree_mask(lengths, tree.visible, span)
        logits, taps = self.target(tree.tokens, lengths[:, None] + tree.depth, slots, mask, self.tap_layers)
        greedy = self.read_greedy(logits, self.root_max_logit[:n])
        decisions = decide(logits, self.sampling[:n], self.generator, sampling, greedy)
        self._mark("verify")
        w = self.walk(tree, decisions, self.max_depth)
        self._mark("walk")
        if self.path_logits is not None:
            path = w.path[..., None].expand(-1, -1, logits.shape[-1])
            self.path_logits[:n].copy_(torch.gather(logits, 1, path)[..., : self.path_logits.shape[-1]])
        if taps is not None:
            if tree.size == 1:  # a round without a draft: the path is the root, the staged context one token
                self.ctx_features[:n, :1].copy_(taps)
            else:
                path = w.path[..., None].expand(-1, -1, taps.shape[-1])
                torch.gather(taps, 1, path, out=self.ctx_features[:n])
        self.commit_path(n, w, moves=self.max_depth > 0 and tree.size > 1, staged=taps is not None)
        self._mark("commit")

    def commit_path(self, n: int, w: Walk, moves: bool, staged: bool) -> None:
        """The walk's outcome into rows [0, n)'s state: with `moves` the accepted path's cache slots go to
        the committed positions (inactive rows move their trash slot); with `staged` the count of staged
        context features is the accepted count; active rows' lengths advance; the bonus and the readout
        (accepted count, emitted tokens) are the walk's. Under the Triton backend: two launches
        (fused.path_committer)."""
        lengths, active = self.lengths[:n], self.active[:n]
        ctx_count = self.ctx_count[:n] if staged else None
        if self.fused_commit is not None:
            self.fused_commit(w, lengths, active, self.bonus[:n], self.readout[:n], ctx_count, moves)
            return
        if moves:
            live, trash = active[:, None], self.target.trash_slot
            steps = torch.arange(self.max_depth + 1, device=self.device)
            self.target.compact(
                torch.where(live, lengths[:, None] + w.path, trash), torch.where(live, lengths[:, None] + steps, trash)
            )
        if ctx_count is not None:
            ctx_count.copy_(w.accepted)
        lengths.copy_(torch.where(active, lengths + w.accepted, lengths))
        self.bonus[:n].copy_(w.bonus)
        self.readout[:n, 0].copy_(w.accepted)
        self.readout[:n, 1 : self.max_depth + 2].copy_(w.emitted)

    def _mark(self, phase: str) -> None:
        """A phase boundary: with `phase_events` (eager rounds) a timing event; with `phase_markers` (a graph
        captured by round_profile.py) a marker kernel that splits the replay's kernel trace; else nothing."""
        if self.phase_events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.phase_events.append((phase, event))
        if self.phase_markers is not None:
            mark_phase()
            self.phase_markers.append(phase)

    def choose_budget(self, n: int) -> int:
        """Budget auto: the budget of the next round on rows [0, n) (the largest until measure_budgets ran)."""
        assert self.budgets is not None
        if not self.budgets.costs:
            return self.plans[n - 1].budget
        rows = [r for r in range(n) if self.host_active[r]]
        return self.budgets.choose(n, self.span_needed(n), rows)

    @torch.inference_mode()
    def step(self, n: int, budget: int | None = None) -> list[list[int]]:
        """Run one round on rows [0, n) and return, per row, the tokens it emitted (idle rows: []). With
        budget auto the round runs `budget` (default: choose_budget's), unless a plan is pinned."""
        if self.budgets is None or self.pinned is not None:
            return self._step(n)
        if budget is None:
            budget = self.choose_budget(n)
        plan = next(p for p in self.candidates(n) if p.budget == budget)
        self.budgets.round_started(time.perf_counter(), n, self.span_needed(n), budget)
        with self.pinned_plan(plan):
            out = self._step(n)
        rows = [r for r in range(n) if self.host_active[r]]
        self.last_forecast = 0.0
        if plan.drafts:
            forecasts = [[v / FORECAST_SCALE for v in self.last_forecasts[r]] for r in rows]
            self.budgets.observe(budget, rows, [len(out[r]) for r in rows], forecasts)
            at = self.budgets.forecast_budgets.index(budget)
            self.last_forecast = sum(f[at] for f in forecasts)
        return out

    def _step(self, n: int) -> list[list[int]]:
        for row in range(n):
            if self.host_active[row] and not self.grow(row):
                raise OutOfPages(
                    f"row {row} needs more KV cache pages for its round than the pool has available "
                    f"({self.page_pool.available}); the scheduler preempts a request first (Scheduler._make_room)"
                )
        sampling = any(self.host_sampling[:n])
        needed = self.span_needed(n)
        plan, last = self.plan(n), self.last_plan
        if self.drafter is not None and not plan.drafts and last is not None and last.drafts:
            # a drafting round staged up to max_depth + 1 tokens of context: written here, eagerly (only
            # when the batch grows past the sizes that draft), so that the round's graph writes one token
            self.drafter.append_context(self.ctx_features[:n], *self.pending_context(n))
            self.ctx_count[:n].zero_()
        self.last_plan = plan
        if self.graphs is None or not self.graphs.run(n, needed, sampling):
            self.eager_rounds += 1
            self.round(n, min(self.max_slots, -(-needed // 128) * 128), sampling)
        readout = self.readout[:n].tolist()  # the one host sync of the round
        forecast_at = self.max_depth + 2
        self.last_forecasts = [result[forecast_at:] for result in readout]
        out: list[list[int]] = []
        for row, result in enumerate(readout):  # [accepted, emitted tokens, forecasts]
            if not self.host_active[row]:
                out.append([])
                continue
            self.host_lengths[row] += result[0]
            self.host_emitted[row] = result[0]
            out.append(result[1 : 1 + result[0]])
            self.texts[row] += out[-1]
        return out

    @torch.inference_mode()
    def override(self, fixes: dict[int, tuple[int, Tensor]]) -> dict[int, int]:
        """Constrained decoding (constrained.py): for each row, {row: (at, allowed)}, replace the token it
        emitted at index `at` of its last round (0 after the prefill) by the target's choice among `allowed`
        ([vocab] bool) from the same logits and sampling settings, and drop the tokens it emitted after it:
        its committed text and staged drafter context end before the new token, which roots the next tree.
        Returns {row: token}; one host sync. Needs an engine made with logprobs=True (the path's logits).

        At T > 0 the draw is from the target's processed distribution (top-k, top-p, min-p) restricted to
        `allowed` (from `allowed`'s own temperature distribution when that holds none of them): with the
        refused draw before it, a rejection sampler of that restricted distribution."""
        if self.path_logits is None:
            raise ValueError("constrained decoding needs the path's logits: make the engine with logprobs=True")
        rows = list(fixes)
        dev = self.device
        index = torch.tensor(rows, device=dev)
        at = torch.tensor([fixes[r][0] for r in rows], device=dev)
        allowed = torch.stack([fixes[r][1] for r in rows]).to(dev)
        logits = self.path_logits[index, at].float()
        masked = logits.masked_fill(~allowed, float("-inf"))
        chosen = masked.argmax(-1)
        if any(self.host_sampling[r] for r in rows):
            settings = self.sampling[index]
            temperature = settings.temperature
            probs = processed_probs(logits, settings) * allowed
            unfiltered = RowSampling(
                temperature,
                torch.ones_like(temperature),
                torch.zeros_like(settings.top_k),
                torch.zeros_like(temperature),
            )
            anywhere = processed_probs(masked, unfiltered)
            probs = torch.where(probs.sum(-1, keepdim=True) > 0, probs, anywhere)
            race = torch.empty_like(probs).exponential_(generator=self.generator)
            chosen = torch.where(temperature > 0, (probs / race).argmax(-1), chosen)
        cut = [self.host_emitted[r] - 1 - fixes[r][0] for r in rows]
        drop = torch.tensor(cut, device=dev)
        self.lengths[index] -= drop
        self.ctx_count[index] = (self.ctx_count[index] - drop).clamp(min=0)
        self.bonus[index] = chosen
        tokens = chosen.tolist()
        for r, k, token in zip(rows, cut, tokens):
            del self.texts[r][len(self.texts[r]) - k - 1 :]  # the replaced token and those after it
            self.texts[r].append(token)
            self.host_lengths[r] -= k
            self.host_emitted[r] -= k
        return dict(zip(rows, tokens))

    def capture_graphs(
        self,
        batch_buckets: list[int] | None = None,
        span_buckets: list[int] | None = None,
        sampling: tuple[bool, ...] = (False,),
        fallback: bool = False,
    ) -> float:
        """Run the prefill shapes once (`warm_up`), then capture CUDA graphs of whole rounds (see graphs.py);
        returns the capture time in seconds."""
        from .graphs import RoundGraphs

        self.warm_up()
        buckets = batch_buckets or [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= self.max_batch_size]
        self.graphs = RoundGraphs(self, buckets, span_buckets, fallback)
        return self.graphs.capture(sampling)

    @torch.inference_mode()
    def measure_budgets(self, repeats: int = 3) -> dict[tuple[int, int], dict[int, float]]:
        """Budget auto: the round time of every candidate budget per batch bucket, which choose_budget weighs
        forecasts against. With CUDA graphs, each greedy graph's replay (so per attention span too);
        eagerly, a round per batch bucket at the smallest span, after one warm-up round. Must run while no
        request is active; returns {(batch bucket, span): {budget: seconds}}."""
        if self.budgets is None:
            return {}
        if any(self.host_active):
            raise RuntimeError("measure budgets before admitting requests")
        if self.graphs is not None:
            costs = self.graphs.time_replays(repeats)
        else:
            costs = {}
            span = self.span_buckets[0]
            for bucket in sorted(
                {b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < self.max_batch_size} | {self.max_batch_size}
            ):
                table = costs.setdefault((bucket, self.max_slots), {})
                for plan in self.candidates(bucket):
                    with self.pinned_plan(plan):
                        self.round(bucket, span, False)
                        times = []
                        for _ in range(repeats):
                            self._sync()
                            start = time.perf_counter()
                            self.round(bucket, span, False)
                            self._sync()
                            times.append(time.perf_counter() - start)
                    table[plan.budget] = sorted(times)[len(times) // 2]
            self.lengths.zero_()
            self.ctx_count.zero_()
        self.budgets.costs = costs
        return costs

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- offline batch generation -----------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Generate for up to max_batch_size prompts at once (rows 0..len-1)."""
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not prompts or len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts; this engine takes 1 to {self.max_batch_size}")
        for p, sp in zip(prompts, params):
            self.check_request(p, sp)
        n = len(prompts)
        for row in range(self.max_batch_size):
            self.release(row)
        if self.budgets is not None and not self.budgets.costs:
            self.measure_budgets()
        start = time.perf_counter()
        out: list[list[int]] = [[] for _ in prompts]
        accepted: list[list[int]] = [[] for _ in prompts]
        finish = [""] * n
        done_at = [0.0] * n

        def take(i: int, toks: list[int]) -> None:
            """Append emitted tokens, cut at the first stop token or at max_new_tokens."""
            room = params[i].max_new_tokens - len(out[i])
            toks = toks[:room]
            for k, t in enumerate(toks):
                if t in params[i].stop_token_ids:
                    toks, finish[i] = toks[: k + 1], "stop"
                    break
            out[i].extend(toks)
            if not finish[i] and len(out[i]) >= params[i].max_new_tokens:
                finish[i] = "length"
            if finish[i]:
                done_at[i] = time.perf_counter()
                self.release(i)

        if params[0].seed is not None:
            self.generator.manual_seed(params[0].seed)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            first = self.add(i, p, SamplingParams(**{**sp.__dict__, "seed": None}))
            take(i, [first])
        while not all(finish):
            for i, toks in enumerate(self.step(n)):
                if toks and not finish[i]:
                    before = len(out[i])
                    take(i, toks)
                    accepted[i].append(len(out[i]) - before)
        return [
            GenerationResult(
                token_ids=out[i],
                finish_reason=finish[i],
                rounds=len(accepted[i]),
                prompt_tokens=len(prompts[i]),
                elapsed_seconds=done_at[i] - start,
                accepted_per_round=accepted[i],
            )
            for i in range(n)
        ]

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("empty prompt")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context "
                f"of {self.max_seq_len} tokens"
            )
        if self.request_pages(prompt, params) > self.page_pool.pages:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) needs "
                f"{self.request_pages(prompt, params) * PAGE_SIZE} cache slots, more than the whole KV cache "
                f"({self.page_pool.pages * PAGE_SIZE} tokens)"
            )
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0 or not 0 <= params.min_p <= 1:
            raise ValueError("temperature must be >= 0, top_p in (0, 1], top_k >= 0 and min_p in [0, 1]")
        bad = [t for t in prompt if not 0 <= t < self.target.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary of {self.target.config.vocab_size}")
