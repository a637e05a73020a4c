"""``RequestStream``: one request's outputs on their way from the engine thread to the handler
that reads them (the async engine's and the engine-core client's)."""

from __future__ import annotations

import asyncio

from llmserve.outputs import RequestOutput


class RequestStream:
    """The outputs of one request, fed by the engine thread, read by one handler.

    Outputs are cumulative, so the stream keeps only the newest one: a handler that falls
    behind skips to it. An exception (the engine failed) replaces it and stays."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.is_finished = False
        self._item: RequestOutput | Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        if not isinstance(self._item, Exception):
            self._item = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The newest output not yet read; waits for one."""
        while self._item is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._item = self._item, None
        if isinstance(item, Exception):
            self._item = item  # every later get raises it too
            self.is_finished = True
            raise item
        self.is_finished = item.finished
        return item
