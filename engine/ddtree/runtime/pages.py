"""The KV cache's pages: fixed runs of PAGE_SIZE physical slots, handed to the engine's rows and shared
between them by content.

A row's logical slots map to physical ones page by page (the models' `slot_map`), so a row holds only
the pages its request can fill, and a full page of text (a prompt's, or a finished request's prompt and
reply) is indexed by a digest of its tokens and of every token before it. A later prompt that starts with
the same pages maps them into its own row (reference-counted) and prefills only the rest: the target's
keys and values and the drafter's context of those tokens sit at the same physical slots. Pages no row
holds stay indexed until they are needed for new text, least recently released first.

Shared pages are never written: a row writes only past its prompt's shared pages (its prefill, its trees,
the drafter's block), and `match` shares no page that holds the prompt's last token, whose forward gives
the first generated token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from ..config import PAGE_SIZE


class OutOfPages(RuntimeError):
    """More pages asked for than are free or evictable (the scheduler admits by free pages first)."""


def page_digests(tokens: Sequence[int], page_size: int = PAGE_SIZE) -> list[bytes]:
    """One digest per full page of `tokens`, each covering the page's tokens and all before it."""
    out, prev = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = hashlib.blake2b(prev + array("q", tokens[start : start + page_size]).tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


class PagePool:
    """`pages` pages of `page_size` slots (page p holds physical slots p * page_size .. + page_size - 1),
    reference-counted, with an index of full pages by content."""

    def __init__(self, pages: int, page_size: int = PAGE_SIZE):
        if pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got {pages}")
        self.pages, self.page_size = pages, page_size
        self.free = list(range(pages - 1, -1, -1))  # a stack: the lowest page is taken first
        self.refs = [0] * pages
        self.digest_of: dict[int, bytes] = {}  # indexed pages
        self.page_of: dict[bytes, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # indexed pages nobody holds, oldest first

    @property
    def available(self) -> int:
        """Pages that can be handed out: free ones and idle indexed ones (evicted on demand)."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        """Pages some row holds."""
        return self.pages - self.available

    def pages_for(self, slots: int) -> int:
        return -(-slots // self.page_size)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The indexed pages holding the longest run of whole pages at the start of `tokens` (not acquired)."""
        found = []
        for digest in page_digests(tokens, self.page_size):
            page = self.page_of.get(digest)
            if page is None:
                break
            found.append(page)
        return found

    def acquire(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self.refs[page] == 0:
                self.idle.pop(page, None)
            self.refs[page] += 1

    def take(self, n: int) -> list[int]:
        """n pages for new text (held once each): free pages first, then the least recently released
        indexed ones, whose index entries go."""
        if n > self.available:
            raise OutOfPages(f"{n} KV cache pages needed, {self.available} of {self.pages} available")
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.idle.popitem(last=False)
                del self.page_of[self.digest_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """Drop one hold of each page; a page nobody holds stays indexed (idle) or becomes free."""
        for page in pages:
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released more often than held"
            if self.refs[page] == 0:
                if page in self.digest_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def publish(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Index the full pages of `tokens`, held by a row as `pages` (its first pages, in order), for later
        prompts. A page whose content another page already has is left out of the index."""
        for page, digest in zip(pages, page_digests(tokens, self.page_size)):
            if digest in self.page_of or page in self.digest_of:
                continue
            self.page_of[digest] = page
            self.digest_of[page] = digest
