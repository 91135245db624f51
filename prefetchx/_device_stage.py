"""The device stage: batches copied to the accelerator ahead of time, on a side stream."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from prefetchx._batch import iter_tensors, map_input, map_tensors
from prefetchx._checks import check_int
from prefetchx._device import CudaStreams
from prefetchx._engine import Failure, Signal
from prefetchx._normalize import Normalize
from prefetchx._stats import EpochStats, Tally
from prefetchx._thread_stage import ThreadStage


class DeviceStage(Iterator[Any]):
    """Copy each batch of ``source`` to ``device`` ahead of time and normalize its input there.

    Every tensor leaf of a batch (nested tuples, lists, dicts, namedtuples, dataclasses) is
    copied with its dtype unchanged; other leaves pass through; only the input that
    ``input_key`` selects is normalized.

    Stream invariants, with ``streams`` (CUDA):

    * Streams: all copies and normalization run on ``streams.side``, one side stream per loader
      and device, created once with the device named. The caller's work stays on its current
      stream.
    * Fence before: before a batch's copies, the side stream waits for the caller's current
      stream, so no copy overtakes work the caller queued earlier.
    * Fence after: an event is recorded on the side stream after each batch's work; handing the
      batch over makes the caller's current stream wait for that event only, never for the
      batches behind it.
    * Reuse: every tensor handed over is ``record_stream``-ed on the caller's stream, so the
      caching allocator, which allocated it on the side stream, cannot reuse its memory before
      the caller's work on it is done.
    * Depth: at most ``device_prefetch`` batches are on the device besides the one the caller
      holds. Copies start only for host batches the thread stage already has waiting, right
      after a batch is handed over; ``next()`` waits for the source only when nothing is in
      flight. ``0`` copies each batch when it is asked for.
    * Host memory: ``non_blocking`` copies are asynchronous only from pinned memory; the loader
      pins by default when the target is CUDA.

    Without ``streams`` (MPS and other accelerators) copies are blocking on the current stream.

    Outcomes keep their order: an exception raised for a batch (by the source, the copy or the
    normalization) is raised in that batch's turn, after the batches before it, and the next
    ``next()`` goes on with the batches after it. A Ctrl-C while waiting for the source is
    raised at once and loses nothing.

    This stage faces the loop, so it records the loop's wait and step in the thread stage's
    `EpochStats`.

    Args:
        source: Host batches: the thread stage, which must not park (``adaptive=False``).
        device: Where batches go.
        streams: The device's stream operations, or ``None`` for blocking copies.
        normalize: What to do to the input once it is on the device.
        input_key: Which element of a batch is the input.
        device_prefetch: Batches in flight on the device.
        non_blocking: Queue copies asynchronously (with ``streams``).
    """

    def __init__(
        self,
        source: ThreadStage[Any],
        device: torch.device,
        *,
        streams: CudaStreams | None,
        normalize: Normalize,
        input_key: int | str = 0,
        device_prefetch: int = 1,
        non_blocking: bool = True,
    ) -> None:
        self.device = device
        self.device_prefetch = check_int("device_prefetch", device_prefetch, minimum=0)
        self._upstream: ThreadStage[Any] | None = source
        self._thread_stage = source
        self.stats: EpochStats = source.stats
        self.tally = Tally(self.stats.wait)
        self._upstream_ended = False
        self._streams = streams
        self._normalize = normalize
        self._input_key = input_key
        self._non_blocking = non_blocking and streams is not None
        # Each entry: (batch on the device, its completion event), or a Failure in its turn.
        self._in_flight: collections.deque[tuple[Any, Any] | Failure] = collections.deque()
        self._returned_at: float | None = None

    def __iter__(self) -> DeviceStage:
        return self

    def __next__(self) -> Any:
        asked_at = time.perf_counter()
        if self._returned_at is not None:
            self.stats.step.add(asked_at - self._returned_at)
        in_flight = self._in_flight
        if not in_flight:
            upstream = self._upstream
            if upstream is None or self._upstream_ended:
                self._finish()
            try:
                value = upstream.take(block=True)
            except StopIteration:
                self._upstream_ended = True
                self._finish()
            self._admit(value)
        head = in_flight.popleft()
        if head.__class__ is Failure:
            self._top_up()
            self._returned(asked_at)
            self.stats.errors += 1
            head.reraise()
        batch, event = head  # type: ignore[misc]
        if self._streams is not None:
            consumer = self._streams.consumer()
            self._streams.wait(consumer, event)
            for tensor in iter_tensors(batch):
                self._streams.hand_over(tensor, consumer)
        # The next batches' copies overlap the caller's work on this one.
        self._top_up()
        self._returned(asked_at)
        return batch

    def _returned(self, asked_at: float) -> None:
        returned_at = time.perf_counter()
        if self._returned_at is None:
            self.stats.warmup_s = returned_at - asked_at
        self._returned_at = returned_at
        self.stats.wait.add(returned_at - asked_at)

    def _finish(self) -> NoReturn:
        """Nothing in flight and nothing more upstream: the stage is done."""
        self.tally.ended = self._upstream_ended
        self.close()
        raise StopIteration

    def _top_up(self) -> None:
        """Start copies for host batches already waiting, up to ``device_prefetch`` in flight."""
        upstream = self._upstream
        while (
            len(self._in_flight) < self.device_prefetch
            and upstream is not None
            and not self._upstream_ended
        ):
            try:
                value = upstream.take(block=False)
            except StopIteration:
                self._upstream_ended = True
                return
            if value is Signal.NOT_READY:
                return
            self._admit(value)

    def _admit(self, value: Any) -> None:
        """Queue one outcome: start a batch's copy and normalization, or keep a failure in turn."""
        if value.__class__ is Failure:
            self._in_flight.append(value)
            return
        try:
            self._in_flight.append(self._start(value))
        except KeyboardInterrupt:
            raise  # Ctrl-C during a copy: now, as DataLoader raises it during a fetch
        except BaseException as exc:
            self._in_flight.append(Failure(exc))

    def _start(self, host: Any) -> tuple[Any, Any]:
        """Queue one batch's copy and normalization; return it with its completion event."""
        if self._streams is None:
            return self._transfer(host), None
        self._streams.side_waits_for(self._streams.consumer())
        with self._streams.on_side():
            batch = self._transfer(host)
            return batch, self._streams.mark_side()

    def _transfer(self, host: Any) -> Any:
        batch = map_tensors(host, self._copy)
        if self._normalize.active:
            batch = map_input(batch, self._input_key, self._normalize)
        return batch

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=self._non_blocking)

    def abandon(self) -> None:
        """Nothing else will use the source (see `ThreadStage.abandon`)."""
        self._thread_stage.abandon()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread stage's background thread, if any."""
        return self._thread_stage.thread

    @property
    def producer_alive(self) -> bool:
        """Whether the thread stage behind this one is still running."""
        return self._thread_stage.producer_alive

    def close(self) -> None:
        """Stop the stages behind this one and free the batches in flight. Idempotent."""
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        self._in_flight.clear()

    def __enter__(self) -> DeviceStage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
