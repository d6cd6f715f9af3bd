"""The KV cache's page pool (runtime/pages.py): allocation, reference counts, the content index and
its eviction order."""

import pytest

from ddtree.runtime.pages import OutOfPages, PagePool, page_digests


def test_pages_are_taken_free_first_and_come_back_when_released():
    pool = PagePool(4, page_size=2)
    a = pool.take(3)
    assert sorted(a) == [0, 1, 2] and pool.used == 3 and pool.available == 1
    with pytest.raises(OutOfPages, match="2 KV cache pages needed, 1 of 4 available"):
        pool.take(2)
    assert pool.used == 3  # a refused take takes nothing
    pool.release(a)
    assert pool.used == 0 and pool.available == 4 and pool.refs == [0, 0, 0, 0]


def test_digests_cover_whole_pages_and_everything_before_them():
    assert len(page_digests([1, 2, 3, 4, 5], page_size=2)) == 2  # the half page has none
    a, b = page_digests([1, 2, 3, 4], 2), page_digests([9, 9, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1]  # the same second page after another first one is another page
    assert page_digests([1, 2, 3, 4, 5, 6], 2)[:2] == a


def test_published_pages_are_matched_by_prompts_that_start_alike_and_shared():
    pool = PagePool(8, page_size=2)
    row = pool.take(3)
    pool.publish(row, [1, 2, 3, 4, 5])  # two full pages; the third is not full
    assert pool.match([1, 2, 3, 4, 5, 6, 7]) == row[:2]
    assert pool.match([1, 2, 3, 9]) == row[:1] and pool.match([7, 2, 3, 4]) == []
    pool.acquire(row[:2])
    assert pool.refs[row[0]] == 2 and pool.used == 3  # shared: counted once
    pool.release(row)
    assert pool.used == 2 and pool.available == 6


def test_idle_indexed_pages_are_evicted_least_recently_released_first():
    pool = PagePool(4, page_size=2)
    first, second = pool.take(2), pool.take(2)
    pool.publish(first, [1, 2, 3, 4])
    pool.publish(second, [5, 6, 7, 8])
    pool.release(second)
    pool.release(first)  # released last: evicted last
    assert pool.available == 4 and pool.used == 0
    assert pool.match([1, 2, 3, 4]) == first and pool.match([5, 6, 7, 8]) == second
    got = pool.take(2)
    assert sorted(got) == sorted(second) and pool.match([5, 6, 7, 8]) == []  # its index entries went
    assert pool.match([1, 2, 3, 4]) == first
    pool.acquire(first)  # an idle page held again is no longer evictable
    with pytest.raises(OutOfPages):
        pool.take(1)
