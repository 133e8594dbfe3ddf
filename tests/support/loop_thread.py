"""An asyncio event loop on a daemon thread of its own, for synchronous tests that run asynchronous
servers beside them (mock engines, an in-process gateway): ``run(coro, timeout)`` waits for one
coroutine on that loop; ``close()`` stops the loop and joins its thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "test-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs ``coro`` on the loop; its result, or TimeoutError after ``timeout`` seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.loop.is_running():
            self.loop.close()
