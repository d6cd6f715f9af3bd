"""What the scheduler asks a stand-in engine about KV cache pages, answered as by a pool that never runs
out and shares nothing: for scripted engines that test the serving path without a model."""

from ddtree.runtime.pages import PagePool


class UnlimitedPages:
    page_pool = PagePool(1 << 20)

    def pages_needed(self, prompt, params, reuse=False) -> int:
        return 0

    def request_pages(self, prompt, params) -> int:
        return 0

    def pages_wanted(self, row) -> int:
        return 0

    def grow(self, row) -> bool:
        return True
