"""A small in-flight batching scheduler: requests wait here until a KV slot is free.

Thread-safe, so a server can ``submit`` from request threads while one decoding loop
calls ``admit`` between steps. When the cache is full, requests simply stay queued —
capacity exhaustion is back-pressure, never a crash.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from specdec.runtime.kv import KVCacheManager
from specdec.runtime.request import Request, SeqState


class Scheduler:
    """FIFO admission bounded by ``max_batch`` live sequences and the free KV slots."""

    def __init__(self, max_batch: int, on_admit: Callable[[list[SeqState]], None] | None = None) -> None:
        """``on_admit`` is called on the loop thread after every admission (a server learns
        there, at each step boundary, which sequences hold slots)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self._on_admit = on_admit
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("scheduler is closed: the engine is shutting down")
            self._queue.append(request)
            self._cond.notify_all()

    def close(self) -> None:
        """No new requests; loops finish what is queued and live, then return."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is queued or the scheduler closes; True if work is queued."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed, timeout=timeout)
            return bool(self._queue)

    def admit(
        self,
        kv: KVCacheManager,
        num_live: int,
        accept: Callable[[Request], bool] | None = None,
        *,
        slots: Callable[[Request], int] | None = None,
        free: int | None = None,
    ) -> list[SeqState]:
        """Pop queued requests into fresh slots while there is room in the batch and the cache.

        ``accept`` may veto a request (e.g. it was cancelled while queued); vetoed requests
        are dropped without taking a slot. A beam request holds up to ``slots(request)`` KV
        slots (one per beam) and is admitted only when that many of ``free`` (default: the
        cache's free slots; a beam loop passes what its live beams have not reserved) are
        left; it gets one slot now and forks the others as its beams branch.
        """
        admitted: list[SeqState] = []
        available = kv.num_free if free is None else free
        with self._cond:
            while self._queue and num_live + len(admitted) < self.max_batch and kv.num_free > 0:
                need = 1 if slots is None else slots(self._queue[0])
                if need > available:
                    break
                request = self._queue.popleft()
                if accept is not None and not accept(request):
                    continue
                available -= need
                admitted.append(SeqState.start(request, kv.alloc()))
        if self._on_admit is not None:
            self._on_admit(admitted)
        return admitted

    def remove(self, request_id: str) -> Request | None:
        """Take a queued request out before it gets a slot (cancellation); None if not queued."""
        with self._cond:
            for request in self._queue:
                if request.request_id == request_id:
                    self._queue.remove(request)
                    return request
        return None

    def drain(self) -> list[Request]:
        """Remove and return every queued request."""
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
            return queued
