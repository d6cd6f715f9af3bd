"""The server's HTTP app (EngineServer) on 127.0.0.1 in a thread of its own, over an engine the test makes:
the real request path (parsing, prompt preparation, scheduler, responses) without a subprocess."""

from __future__ import annotations

import asyncio
import threading

from ddtree.config import EngineConfig


class InProcessServer:
    """Serves `engine` with `tokenizer` as `model` under the settings `serving` (EngineConfig's serving
    section); `report`, when given, is the smoke report /ready answers with."""

    def __init__(
        self, engine, tokenizer, serving: dict, stop_token_ids: tuple[int, ...] = (), report=None, model: str = "tiny"
    ):
        from aiohttp import web

        from ddtree.serving.app import EngineServer

        config = EngineConfig.from_dict({"model": {"id": model, "device": "cpu"}, "serving": serving})
        self.engine, self.tokenizer = engine, tokenizer
        self.server = EngineServer(config)
        self.server.report = report
        self.server.start_serving(engine, tokenizer, stop_token_ids)
        self.server.phase = "ready"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.server.app())
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()
        self.server.scheduler.stop()
        self.server.preparation.shutdown()
