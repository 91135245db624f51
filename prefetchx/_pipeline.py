"""The two stages wired together, and the lifecycle of the epoch that runs them."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from prefetchx._batch import map_input
from prefetchx._checks import check_bool, check_input_key, check_int
from prefetchx._device import CudaStreams, resolve_device
from prefetchx._device_stage import DeviceStage
from prefetchx._engine import JOIN_TIMEOUT
from prefetchx._normalize import Normalize
from prefetchx._stats import EpochStats, Tally
from prefetchx._thread_stage import ThreadStage

Stage = ThreadStage[Any] | DeviceStage


class Pipeline:
    """The prefetch arguments, checked, and the stages they build over one epoch's batches.

    One per loader. It makes the target's side stream once, and keeps weak references to the
    running epoch so that a dropped iterator still stops its thread, while `stop` can wait for
    that thread before the next epoch touches the source.
    """

    def __init__(
        self,
        *,
        max_prefetch: int,
        device: str | torch.device | int | None,
        mean: Sequence[float] | None,
        std: Sequence[float] | None,
        dtype: torch.dtype | None,
        channels_last: bool,
        input_key: int | str,
        device_prefetch: int,
        non_blocking: bool,
    ) -> None:
        self.max_prefetch = check_int("max_prefetch", max_prefetch, minimum=0)
        self.input_key = check_input_key(input_key)
        self.device_prefetch = check_int("device_prefetch", device_prefetch, minimum=0)
        self.non_blocking = check_bool("non_blocking", non_blocking)
        self.normalize = Normalize(mean, std, dtype, channels_last)
        self.target = resolve_device(device)
        self._streams: CudaStreams | None = None
        self._stage_ref: weakref.ref[Stage] | None = None
        self._thread_ref: weakref.ref[threading.Thread] | None = None
        self.stats = EpochStats()
        self.tally: Tally | None = None

    def start(self, batches: Iterator[Any]) -> Stage:
        """The stages over one epoch's host batches: a thread, then the device if there is one."""
        stage: Stage
        if self.target.type == "cpu":
            if self.normalize.active:  # in the thread, so it overlaps the caller's step
                batches = map(self._normalize_input, batches)
            stage = ThreadStage(batches, self.max_prefetch)
        else:
            stage = DeviceStage(
                ThreadStage(batches, self.max_prefetch, device=self.target),
                self.target,
                streams=self._side_streams(),
                normalize=self.normalize,
                input_key=self.input_key,
                device_prefetch=self.device_prefetch,
                non_blocking=self.non_blocking,
            )
        self._stage_ref = weakref.ref(stage)
        thread = stage.thread
        self._thread_ref = weakref.ref(thread) if thread is not None else None
        self.stats = stage.stats
        self.tally = stage.tally
        return stage

    def stop(self) -> bool:
        """Stop the running epoch's thread and wait for it, bounded; whether it is still alive."""
        stage = self._stage_ref() if self._stage_ref is not None else None
        thread = self._thread_ref() if self._thread_ref is not None else None
        self._stage_ref = self._thread_ref = None
        if stage is not None:
            stage.close()  # stops the thread and waits for it, bounded
        elif thread is not None and thread is not threading.current_thread():
            # The stage was dropped after an interrupt, which stops the thread without waiting;
            # threading keeps a running thread referenced, so the weak reference still holds.
            thread.join(JOIN_TIMEOUT)
        return thread is not None and thread.is_alive()

    def _normalize_input(self, batch: Any) -> Any:
        return map_input(batch, self.input_key, self.normalize)

    def _side_streams(self) -> CudaStreams | None:
        """The target's side stream, made once; ``None`` where copies are blocking."""
        if self.target.type != "cuda":
            return None  # MPS corrupts non_blocking copies (pytorch #83015); others: no streams
        if self._streams is None:
            self._streams = CudaStreams(self.target)
        return self._streams
