"""The device stage: batches copied to the accelerator ahead of time, on a side stream."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from prefetchx._batch import iter_tensors, map_input, map_tensors
from prefetchx._checks import check_int
from prefetchx._device import Copies, CudaStreams, dense_parts
from prefetchx._engine import Failure, Signal
from prefetchx._normalize import Normalize
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import ThreadStage


class DeviceStage(Iterator[Any]):
    """Copy each batch of ``source`` to ``device`` ahead of time and normalize its input there.

    Every tensor leaf of a batch (nested tuples, lists, dicts, namedtuples, dataclasses) is
    copied with its dtype unchanged, except a leaf already on the device, which is used as it
    is; other leaves pass through; only the input that ``input_key`` selects is normalized.

    Stream invariants, with ``streams`` (CUDA):

    * Streams: all copies and normalization run on ``streams.side``, one side stream per loader
      and device, created once with the device named. The caller's work stays on its current
      stream.
    * Fence before: before a batch's copies, the side stream waits for the caller's current
      stream, so no copy overtakes work the caller queued earlier.
    * Fence after: an event is recorded on the side stream after each batch's work; handing the
      batch over makes the caller's current stream wait for that event only, never for the
      batches behind it.
    * Reuse, device memory: every tensor the side stream reads or writes is protected
      (``record_stream``) for exactly the streams that use it besides the one it was allocated
      on. A batch's outputs, allocated on the side stream, are protected for the caller's stream
      when handed over; a source leaf already on the device (allocated on another stream) that
      the side stream normalizes is protected for the side stream. A sparse leaf is protected
      through its dense parts.
    * Reuse, host memory: each host batch stays referenced until the event after its copy has
      completed, so memory that torch's caching host allocator does not manage (a buffer the
      user pinned) is not freed under a copy in flight. Do not write into a batch's host memory
      after the dataset or collate function has returned it.
    * Depth: at most ``device_prefetch`` batches are on the device besides the one the caller
      holds. Copies start right after a batch is handed over, for the host batches the thread
      stage gives without waiting for its thread (`ThreadStage.take_ahead`): those its thread
      has waiting, or, while the thread is parked, batches the caller makes then; a take waits
      for the source only when nothing is in flight. ``0`` copies each batch when it is asked
      for, and so does any depth with no thread (``max_prefetch=0``). Device memory held through
      ``record_stream`` is not counted: a batch's memory is reused only once the caller's work
      queued on it before it was freed is done, so a caller that runs ahead of the GPU holds
      the batches of every step it has queued.
    * Host memory: ``non_blocking`` copies are asynchronous only from pinned memory; the
      pipeline pins host leaves in the thread stage.

    The GPU stall meter (``stats.gpu_idle``): for each batch, a pair of timing events on the
    caller's stream, one when the loop asks for the batch and one after the wait for its copy:
    the time between them is time the caller's stream sat idle for data. They are read once
    complete, never waited for.

    Without ``streams`` (MPS and other accelerators) copies are blocking on the current stream.

    Outcomes keep their order: an exception raised for a batch (by the source, the copy or the
    normalization) is handed over in that batch's turn, after the batches before it, and the
    next take goes on with the batches after it. A Ctrl-C while waiting for the source is
    raised at once and loses nothing.

    Args:
        source: Host batches: the thread stage.
        device: Where batches go.
        copies: How tensors get to ``device``: `CudaStreams`, or `Copies` where there are no
            streams.
        streams: The device's stream operations (``copies`` itself for CUDA), or ``None`` for
            blocking copies.
        normalize: What to do to the input once it is on the device.
        input_key: Which element of a batch is the input.
        device_prefetch: Batches in flight on the device.
        non_blocking: Queue copies asynchronously (with ``streams``).
        stats: Where the GPU stall meter goes; a new `EpochStats` by default.
    """

    def __init__(
        self,
        source: ThreadStage[Any],
        device: torch.device,
        *,
        copies: Copies,
        streams: CudaStreams | None,
        normalize: Normalize,
        input_key: int | str = 0,
        device_prefetch: int = 1,
        non_blocking: bool = True,
        stats: EpochStats | None = None,
    ) -> None:
        self.device = device
        self.device_prefetch = check_int("device_prefetch", device_prefetch, minimum=0)
        self._upstream: ThreadStage[Any] | None = source
        self._thread_stage = source
        self.stats = stats if stats is not None else EpochStats()
        self._upstream_ended = False
        self._copies = copies
        self._streams = streams
        self._normalize = normalize
        self._input_key = input_key
        self._non_blocking = non_blocking and streams is not None
        # Each entry: (batch on the device, its completion event, the host batch), or a Failure
        # in its turn.
        self._in_flight: collections.deque[tuple[Any, Any, Any] | Failure] = collections.deque()
        self._copying = Copying(streams)
        self._idle = GpuIdle(streams, self.stats) if streams is not None else None
        if self._idle is not None:
            self.stats.gpu_idle.refresh = self._idle.read
        _let_go()

    def __iter__(self) -> DeviceStage:
        return self

    def __next__(self) -> Any:
        value = self.take()
        if value.__class__ is Failure:
            del self  # the traceback keeps this frame: it must not keep the stage alive
            value.reraise()
        return value

    def take(self) -> Any:
        """The next outcome: a batch on the device, or a `Failure` holding what was raised in
        its place (not raised: whoever faces the loop raises it); `StopIteration` at the end."""
        streams = self._streams
        # The caller's stream, asked once: it cannot change inside this call.
        consumer = streams.consumer() if streams is not None else None
        asked = self._idle.asked(consumer) if self._idle is not None else None
        in_flight = self._in_flight
        if not in_flight:
            upstream = self._upstream
            if upstream is None or self._upstream_ended:
                self._finish()
            try:
                value = upstream.take()
            except StopIteration:
                self._upstream_ended = True
                self._finish()
            self._admit(value, consumer)
        head = in_flight.popleft()
        if head.__class__ is Failure:
            self._top_up(consumer)
            return head
        batch, event, host = head  # type: ignore[misc]
        if streams is not None:
            streams.wait(consumer, event)
            for tensor in iter_tensors(batch):
                for part in dense_parts(tensor):
                    streams.protect(part, consumer)
            self._copying.add(host, event)
            if self._idle is not None:
                self._idle.handed(asked, consumer)
        # The next batches' copies overlap the caller's work on this one.
        self._top_up(consumer)
        return batch

    def _finish(self) -> NoReturn:
        """Nothing in flight and nothing more upstream: the stage is done."""
        self.close()
        raise StopIteration

    def _top_up(self, consumer: Any) -> None:
        """Start copies for host batches already waiting, up to ``device_prefetch`` in flight.

        ``consumer``: the caller's current stream (``None`` without streams).
        """
        upstream = self._upstream
        while (
            len(self._in_flight) < self.device_prefetch
            and upstream is not None
            and not self._upstream_ended
        ):
            try:
                value = upstream.take_ahead()
            except StopIteration:
                self._upstream_ended = True
                return
            if value is Signal.NOT_READY:
                return
            self._admit(value, consumer)

    def _admit(self, value: Any, consumer: Any) -> None:
        """Queue one outcome: start a batch's copy and normalization, or keep a failure in turn."""
        if value.__class__ is Failure:
            self._in_flight.append(value)
            return
        try:
            self._in_flight.append(self._start(value, consumer))
        except KeyboardInterrupt:
            raise  # Ctrl-C during a copy: now, as DataLoader raises it during a fetch
        except BaseException as exc:
            self._in_flight.append(Failure(exc))

    def _start(self, host: Any, consumer: Any) -> tuple[Any, Any, Any]:
        """Queue one batch's copy and normalization; return it with its completion event.

        ``consumer``: the caller's current stream, which the side stream waits for first.
        """
        streams = self._streams
        if streams is None:
            return self._transfer(host, None), None, None
        if self._normalize.active:
            # Made before the fence: a first use must not copy the constants behind it.
            self._normalize.prepare(self.device)
        streams.side_waits_for(consumer)
        with streams.on_side(consumer):
            batch = self._transfer(host, streams)
            return batch, streams.mark(streams.side), host

    def _transfer(self, host: Any, streams: CudaStreams | None) -> Any:
        copies, non_blocking = self._copies, self._non_blocking
        local: list[torch.Tensor] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if copies.is_local(tensor):
                local.append(tensor)
                return tensor
            return copies.copy(tensor, non_blocking)

        batch = map_tensors(host, copy)
        if not self._normalize.active:
            return batch

        def normalize(tensor: torch.Tensor) -> torch.Tensor:
            out = self._normalize(tensor)
            if streams is not None and any(tensor is leaf for leaf in local):
                # Allocated on another stream, read here: its owner may drop it once the batch
                # is queued, and its memory must outlive this read.
                for part in dense_parts(tensor):
                    streams.protect(part, streams.side)
            return out

        return map_input(batch, self._input_key, normalize)

    def abandon(self) -> None:
        """Nothing else will use the source (see `ThreadStage.abandon`)."""
        self._thread_stage.abandon()

    @property
    def producer_alive(self) -> bool:
        """Whether the thread stage behind this one is still running."""
        return self._thread_stage.producer_alive

    def close(self) -> None:
        """Stop the stages behind this one and free the batches in flight. Idempotent.

        Host batches whose copies may still be running stay referenced until they finish.
        """
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        for entry in self._in_flight:
            if entry.__class__ is not Failure:
                _, event, host = entry  # type: ignore[misc]
                self._copying.add(host, event)
        self._in_flight.clear()
        self._copying.outlive()
        if self._idle is not None:
            self._idle.read()

    def __enter__(self) -> DeviceStage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Copying:
    """Host batches whose copies to the device may still be running, kept until they are done."""

    def __init__(self, streams: CudaStreams | None) -> None:
        self._streams = streams
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()

    def add(self, host: Any, event: Any) -> None:
        """Keep ``host`` until ``event`` (after its copy) is done; let go of those done."""
        if self._streams is None or host is None:
            return
        self._pending.append((host, event))
        self._release()

    def _release(self) -> None:
        pending, done = self._pending, self._streams.done  # type: ignore[union-attr]  # set when any is pending
        while pending and done(pending[0][1]):
            pending.popleft()

    def outlive(self) -> None:
        """The stage is closing: hand what is still copying to the module's keeper."""
        _let_go()
        if self._pending:
            self._release()
            _outliving.append(self)


_outliving: collections.deque[Copying] = collections.deque()
"""Copying records of closed stages with copies not known to be done. Each new one lets go of
those done (a closed stage's last copies finish within a step)."""


def _let_go() -> None:
    for _ in range(len(_outliving)):
        copying = _outliving.popleft()
        copying._release()
        if copying._pending:
            _outliving.append(copying)


class GpuIdle:
    """The GPU stall meter of one stage: how long the caller's stream sat idle for data.

    Per batch, a timing event on the caller's stream when the loop asks and another after the
    stream's wait for the batch's copy; the time between them, once both are done, goes into
    ``stats.gpu_idle`` (the epoch's first batch into ``stats.gpu_warmup_s``). Events are read
    when complete, on later batches or when the meter is read; nothing waits for them.
    """

    def __init__(self, streams: CudaStreams, stats: EpochStats) -> None:
        self._streams = streams
        self._stats = stats
        self._first = True
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()

    def asked(self, consumer: Any) -> Any:
        """The loop asks for a batch: mark its stream, ``consumer``."""
        return self._streams.mark(consumer, timing=True)

    def handed(self, asked: Any, consumer: Any) -> None:
        """The batch was handed over, its wait queued on ``consumer``."""
        self._pending.append((asked, self._streams.mark(consumer, timing=True)))
        if len(self._pending) > 1:
            self.read()

    def read(self) -> None:
        """Move the pairs that are complete into the series; never waits."""
        pending, streams = self._pending, self._streams
        while pending and streams.done(pending[0][1]):
            start, end = pending.popleft()
            idle = streams.elapsed_s(start, end)
            if self._first:
                self._first = False
                self._stats.gpu_warmup_s = idle
            else:
                self._stats.gpu_idle.add(idle)
