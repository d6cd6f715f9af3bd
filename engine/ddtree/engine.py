"""One engine for three methods: `ar` (plain decoding), `dflash` (verify the drafter's argmax chain)
and `ddtree` (verify the top-B prefix tree). They share every step; only the tree differs, and plain
decoding is the root-only tree.

A round, for a batch of sequences of different lengths:
  draft   drafter appends the new context features, runs [bonus, MASK...] -> D draft rows
  tree    root-only / chain / top-B tree, flattened to N = tree size nodes per sequence
  verify  one target forward over the N nodes: slots L..L+N-1, positions L + depth, ancestor mask
  walk    accept the longest path the target agrees with, plus its bonus token
  commit  compact the accepted KV rows to L..L+a-1, stage their tapped hidden states as drafter context
Then one host read of the emitted tokens (EOS and max_new_tokens are applied there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .drafter import DFlashDrafter
from .model import Transformer
from .tree import Tree, build_chain, build_ddtree, root_only
from .verify import Walk, decide, tree_mask, walk

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


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


@dataclass
class BatchState:
    lengths: Tensor  # [bs] committed tokens in the target cache (= the bonus token's position)
    bonus: Tensor  # [bs] last emitted token, not yet in the cache: the root of the next tree
    ctx_features: Tensor | None  # [bs, P, taps*H] tapped target states not yet in the drafter cache
    ctx_count: Tensor  # [bs] valid rows of ctx_features (they end at position lengths - 1)
    active: Tensor  # [bs] bool
    temperature: Tensor  # [bs]
    top_p: Tensor  # [bs]
    sampling: bool  # some sequence samples (T > 0)
    generator: torch.Generator | None


class Engine:
    def __init__(
        self,
        target: Transformer,
        drafter: DFlashDrafter | None = None,
        method: str = "ddtree",
        budget: int | None = None,
        max_batch_size: int = 1,
        max_seq_len: int = 2048,
    ):
        if method not in METHODS:
            raise ValueError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
        if method != "ar" and drafter is None:
            raise ValueError(f"method '{method}' needs a drafter")
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if drafter is not None:
            drafter.config.check_target(target.config)
        self.target, self.method = target, method
        # budget 0 verifies the root only: plain decoding, no drafter work
        self.drafter = drafter if method == "dflash" or (method == "ddtree" and budget != 0) else None
        block = drafter.block_size if drafter is not None else 1
        if method == "ddtree":
            self.budget = block - 1 if budget is None else budget
            self.max_depth = min(self.budget, block - 1)
            self.tree_size = self.budget + 1
        elif method == "dflash":
            self.budget, self.max_depth, self.tree_size = block - 1, block - 1, block
        else:
            self.budget, self.max_depth, self.tree_size = 0, 0, 1
        self.block_size = block
        self.tap_layers = tuple(self.drafter.config.target_layer_ids) if self.drafter else ()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        # room past the committed text for the tree (target) and the block (drafter)
        self.max_slots = max_seq_len + max(self.tree_size, block)
        target.setup_caches(max_batch_size, self.max_slots)
        if self.drafter is not None:
            self.drafter.setup_caches(max_batch_size, self.max_slots)
            self.mask_token_id = self.drafter.config.mask_token_id
        self.device = target.lm_head.weight.device

    # ---- phases of a round -------------------------------------------------------------------

    def _span(self, max_len: int, width: int) -> int:
        """Attention span over cache slots, rounded up so that few distinct shapes occur."""
        return min(self.max_slots, -(-(max_len + width) // 128) * 128)

    def propose(self, st: BatchState, max_len: int) -> Tensor:
        """Drafter forward: [bs, D, V] draft logits for the D positions after the bonus token."""
        bs, block, dev = st.lengths.shape[0], self.block_size, self.device
        steps = torch.arange(block, device=dev)
        block_tokens = torch.full((bs, block), self.mask_token_id, dtype=torch.long, device=dev)
        block_tokens[:, 0] = st.bonus
        block_pos = st.lengths[:, None] + steps
        p = st.ctx_features.shape[1]
        j = torch.arange(p, device=dev)
        ctx_pos = st.lengths[:, None] - st.ctx_count[:, None] + j
        # padding and finished sequences write to the trash slot
        live = (j < st.ctx_count[:, None]) & st.active[:, None]
        ctx_slots = torch.where(live, ctx_pos, self.drafter.max_slots)
        span = self._span(max_len, block)
        mask = (torch.arange(span, device=dev) < (st.lengths[:, None] + block)).view(bs, 1, 1, span)
        mask = mask.expand(bs, 1, block, span)
        hidden = self.drafter(
            self.target.embed(block_tokens), block_pos, block_pos, mask,
            st.ctx_features, ctx_pos.clamp(min=0), ctx_slots,
        )
        st.ctx_features = None  # now in the drafter cache
        return self.target.lm_head(hidden[:, 1 : 1 + self.max_depth])

    def build_tree(self, st: BatchState, max_len: int) -> Tree:
        if self.drafter is None:
            return root_only(st.bonus)
        draft_logits = self.propose(st, max_len)
        if self.method == "dflash":
            return build_chain(st.bonus, draft_logits)
        return build_ddtree(st.bonus, draft_logits, self.budget)

    def verify(self, st: BatchState, tree: Tree, max_len: int) -> tuple[Walk, Tensor | None]:
        n = tree.size
        slots = st.lengths[:, None] + torch.arange(n, device=self.device)
        mask = tree_mask(st.lengths, tree.visible, self._span(max_len, n))
        logits, taps = self.target(tree.tokens, st.lengths[:, None] + tree.depth, slots, mask, self.tap_layers)
        decisions = decide(logits, st.temperature, st.top_p, st.generator, st.sampling)
        return walk(tree, decisions, self.max_depth), taps

    def commit(self, st: BatchState, w: Walk, taps: Tensor | None) -> None:
        if self.max_depth > 0:
            src = st.lengths[:, None] + w.path
            dst = st.lengths[:, None] + torch.arange(self.max_depth + 1, device=self.device)
            self.target.compact(src, dst)
        if taps is not None:
            st.ctx_features = torch.gather(taps, 1, w.path[..., None].expand(-1, -1, taps.shape[-1]))
            st.ctx_count = w.accepted
        st.lengths = torch.where(st.active, st.lengths + w.accepted, st.lengths)
        st.bonus = w.bonus

    # ---- prefill and the generation loop ----------------------------------------------------

    def prefill(self, prompts: list[list[int]], params: list[SamplingParams]) -> BatchState:
        bs, dev = len(prompts), self.device
        n = max(len(p) for p in prompts)
        tokens = torch.zeros(bs, n, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        tokens = tokens.to(dev)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        j = torch.arange(n, device=dev)
        valid = j[None] < lengths[:, None]
        slots = torch.where(valid, j, self.target.trash_slot)
        mask = (j[None, :, None] >= j[None, None, :]) & valid[:, None, :]  # causal, real keys only
        hidden, taps = self.target(tokens, j.expand(bs, n), slots, mask[:, None], self.tap_layers, logits=False)
        rows = torch.arange(bs, device=dev)
        last_logits = self.target.lm_head(hidden[rows, lengths - 1])[:, None]
        seeds = [p.seed for p in params if p.seed is not None]
        temps = torch.tensor([p.temperature for p in params], device=dev)
        sampling = any(p.temperature > 0 for p in params)
        gen = None
        if sampling:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seeds[0] if seeds else int(torch.randint(0, 2**62, ()).item()))
        st = BatchState(
            lengths=lengths,
            bonus=torch.zeros(bs, dtype=torch.long, device=dev),
            ctx_features=taps,
            ctx_count=lengths.clone(),
            active=torch.ones(bs, dtype=torch.bool, device=dev),
            temperature=temps,
            top_p=torch.tensor([p.top_p for p in params], device=dev),
            sampling=sampling,
            generator=gen,
        )
        st.bonus = decide(last_logits, st.temperature, st.top_p, gen, sampling)[:, 0]
        return st

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        self._check_request(prompts, params)
        start = time.perf_counter()
        st = self.prefill(prompts, params)
        host_len = [len(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        accepted: list[list[int]] = [[] for _ in prompts]
        finish = [""] * len(prompts)
        done_at = [0.0] * len(prompts)

        def take(i: int, toks: list[int]) -> None:
            """Append emitted tokens, cut at the first stop token or at max_new_tokens."""
            room = params[i].max_new_tokens - len(out[i])
            for k, t in enumerate(toks[:room]):
                if t in params[i].stop_token_ids:
                    toks, finish[i] = toks[: k + 1], "stop"
                    break
            toks = toks[:room]
            out[i].extend(toks)
            if not finish[i] and len(out[i]) >= params[i].max_new_tokens:
                finish[i] = "length"
            if finish[i]:
                done_at[i] = time.perf_counter()

        for i, b in enumerate(st.bonus.tolist()):
            take(i, [b])
        while not all(finish):
            active = [not f for f in finish]
            st.active = torch.tensor(active, device=self.device)
            max_len = max(host_len)  # finished sequences keep their length and still need in-bounds masks
            tree = self.build_tree(st, max_len)
            w, taps = self.verify(st, tree, max_len)
            self.commit(st, w, taps)
            readout = torch.cat([w.accepted[:, None], w.emitted], dim=1).tolist()  # the one host sync
            for i, row in enumerate(readout):
                if not active[i]:
                    continue
                before = len(out[i])
                take(i, row[1 : 1 + row[0]])
                accepted[i].append(len(out[i]) - before)
                host_len[i] += row[0]
        return [
            GenerationResult(
                token_ids=out[i],
                finish_reason=finish[i],
                rounds=len(accepted[i]),
                prompt_tokens=len(prompts[i]),
                elapsed_seconds=done_at[i] - start,
                accepted_per_round=accepted[i],
            )
            for i in range(len(prompts))
        ]

    def _check_request(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        if not prompts or len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts; this engine takes 1 to {self.max_batch_size}")
        for p, sp in zip(prompts, params):
            if not p:
                raise ValueError("empty prompt")
            if sp.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {sp.max_new_tokens}")
            if len(p) + sp.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt ({len(p)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds the context "
                    f"of {self.max_seq_len} tokens"
                )
            if sp.temperature < 0 or not 0 < sp.top_p <= 1:
                raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
