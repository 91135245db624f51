"""The device stage: batches copied to the accelerator ahead of time, on a side stream."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import torch

from prefetchx._batch import iter_tensors, map_input, map_tensors
from prefetchx._checks import check_int
from prefetchx._device import CudaStreams
from prefetchx._engine import Failure
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
      holds; ``0`` copies each batch when it is asked for.
    * Host memory: ``non_blocking`` copies are asynchronous only from pinned memory; the loader
      pins by default when the target is CUDA.

    Without ``streams`` (MPS and other accelerators) copies are blocking on the current stream.

    An error raised by the source while batches are in flight is raised after those batches
    have been handed over, so no batch is lost; Ctrl-C is raised at once.

    Args:
        source: Host batches, usually a `ThreadStage`.
        device: Where batches go.
        streams: The device's stream operations, or ``None`` for blocking copies.
        normalize: What to do to the input once it is on the device.
        input_key: Which element of a batch is the input.
        device_prefetch: Batches in flight on the device.
        non_blocking: Queue copies asynchronously (with ``streams``).
    """

    def __init__(
        self,
        source: Iterator[Any],
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
        self._source: Iterator[Any] | None = source
        self._upstream = source if isinstance(source, ThreadStage) else None
        self._own_stats = EpochStats()  # empty: only a thread stage source measures
        self.tally = Tally()
        self._source_ended = False
        self._streams = streams
        self._normalize = normalize
        self._input_key = input_key
        self._non_blocking = non_blocking and streams is not None
        self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        self._pending: Failure | None = None

    def __iter__(self) -> DeviceStage:
        return self

    def __next__(self) -> Any:
        self._fill(max(self.device_prefetch, 1))
        if not self._in_flight:
            pending, self._pending = self._pending, None
            self.close()
            if pending is not None:
                pending.reraise()
            self.tally.ended = self._source_ended
            raise StopIteration
        batch, event = self._in_flight.popleft()
        if self._streams is not None:
            consumer = self._streams.consumer()
            self._streams.wait(consumer, event)
            for tensor in iter_tensors(batch):
                self._streams.hand_over(tensor, consumer)
        # The next batch's copy overlaps the caller's work on this one.
        self._fill(self.device_prefetch)
        self.tally.add()
        return batch

    def _fill(self, depth: int) -> None:
        """Start copies until ``depth`` batches are in flight or the source has ended."""
        while len(self._in_flight) < depth and self._source is not None:
            try:
                host = next(self._source)
                self._in_flight.append(self._start(host))
            except StopIteration:
                self._source_ended = True
                self._close_source()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                # Raised after the batches already in flight, which come before it.
                self._pending = Failure(exc)
                self._close_source()

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

    @property
    def stats(self) -> EpochStats:
        """The stall meter of the thread stage behind this one."""
        return self._upstream.stats if self._upstream is not None else self._own_stats

    @property
    def thread(self) -> threading.Thread | None:
        """The thread stage's background thread, if any."""
        return self._upstream.thread if self._upstream is not None else None

    @property
    def producer_alive(self) -> bool:
        """Whether the thread stage behind this one is still running."""
        return self._upstream is not None and self._upstream.producer_alive

    def _close_source(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        self._source = None

    def close(self) -> None:
        """Stop the stages behind this one and free the batches in flight. Idempotent."""
        self._close_source()
        self._in_flight.clear()
        self._pending = None

    def __enter__(self) -> DeviceStage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
