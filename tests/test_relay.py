"""EventRelay: the engine thread's events reach each request's queue in order, with one wake-up of the
event loop per flush."""

from __future__ import annotations

import asyncio
import threading
from unittest import mock

from ddtree.serving import relay as relay_module
from ddtree.serving.relay import EventRelay


def test_a_flushed_burst_from_another_thread_arrives_in_order_with_one_wake_up():
    async def main():
        relay, loop = EventRelay(), asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in range(3)]

        def burst(start):  # as the engine thread: a round's events, then the flush
            for i in range(start, start + 60):
                relay.put(loop, queues[i % 3], i)
            relay.flush()
            relay.flush()  # nothing left: no second wake-up

        with mock.patch.object(relay_module, "_hand_over", wraps=relay_module._hand_over) as hand_over:
            for start in (0, 60):
                worker = threading.Thread(target=burst, args=(start,))
                worker.start()
                await asyncio.to_thread(worker.join)
                got = [[await asyncio.wait_for(q.get(), 5) for _ in range(20)] for q in queues]
                assert got == [list(range(start + k, start + 60, 3)) for k in range(3)]
                assert all(q.empty() for q in queues)
            assert hand_over.call_count == 2
        relay.put(loop, queues[0], "kept")
        await asyncio.sleep(0.05)
        assert queues[0].empty(), "nothing reaches a queue before the flush"
        return relay, loop

    relay, loop = asyncio.run(main())
    relay.put(loop, asyncio.Queue(), "after the loop closed")
    relay.flush()  # shutting down: dropped, no error on the engine thread
