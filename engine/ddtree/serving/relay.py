"""Events from the engine thread to the event loop, one wake-up for all that a scheduler step produced.

The scheduler hands each request's new text to its sink on the engine thread: one event per running
request per round. Waking the event loop for each (`call_soon_threadsafe` writes to the loop's self-pipe)
cost a system call per event, and each woken loop took the GIL from the engine thread between two
events, at 64 streams up to 64 times a round. The relay keeps the events until the scheduler has
delivered them all (`flush`, after the prefill's first tokens and after each round), then wakes the loop
once to put them on their requests' queues, in order.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class EventRelay:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = []

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event: Any) -> None:
        """Keep `event` for `queue` (an asyncio.Queue of `loop`) until the next flush; any thread."""
        with self._lock:
            self._pending.append((loop, queue, event))

    def flush(self) -> None:
        """Wake each loop that put() kept events for, once, to hand them over; any thread."""
        with self._lock:
            pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for loop, queue, event in pending:
            by_loop.setdefault(loop, []).append((queue, event))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_hand_over, events)
            except RuntimeError:  # the event loop is closed (shutting down): nobody is listening
                pass


def _hand_over(events: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)
