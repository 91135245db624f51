"""The two prefetch stages, built from the checked options over a source iterator."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from prefetchx._batch import map_input, map_tensors
from prefetchx._choose import Decision
from prefetchx._device import Copies, CudaStreams, with_index
from prefetchx._device_stage import DeviceStage
from prefetchx._options import PrefetchOptions
from prefetchx._stats import EpochStats
from prefetchx._thread_stage import ThreadStage

Stage = ThreadStage[Any] | DeviceStage
"""The stage that faces the loop: its ``take()`` gives the next outcome."""

_RESOLVING = threading.Lock()


class Pipeline:
    """The stages the options build over one source iterator.

    One per loader. It holds no epoch: every iterator gets its own stages from `build`. It makes
    the target's side stream once, the first time a device stage needs it. The options checked
    ``device`` without initializing CUDA; `target` completes it with the current index at the
    first `build` (the first ``iter()``), once for the pipeline's life.
    """

    def __init__(self, options: PrefetchOptions) -> None:
        self.options = options
        self.normalize = options.normalize
        self.device = options.checked_device  # its index may be None: see target
        self._target: torch.device | None = None
        self.pin_host = True
        """Pin host leaves in the thread stage before their copy to a CUDA device (see
        `_pin`); a loader given ``pin_memory=False`` turns it off."""
        self._streams: CudaStreams | None = None
        self.decision = Decision()
        """Whether the thread runs, from the loop's pace as the loader's epochs measured it."""

    @property
    def target(self) -> torch.device:
        """The device batches go to, with its index: ``device`` with the current index if it has
        none, asked for at the first use (which initializes CUDA) and then kept."""
        if self._target is None:
            with _RESOLVING:  # two threads' first iter() must agree on one device
                if self._target is None:
                    self._target = with_index(self.device)
        return self._target

    def build(
        self,
        source: Iterator[Any],
        stats: EpochStats,
        *,
        reapable: bool = False,
        limit: int | None = None,
        source_name: str | None = None,
    ) -> tuple[ThreadStage[Any], Stage]:
        """The stages over ``source``: a thread, then the device if there is one.

        Returns the thread stage, which `switch`es between its thread and the caller, and the
        stage that faces the loop (the same on the CPU). ``reapable``, ``limit`` and
        ``source_name``: see `ThreadStage`.
        """
        if self.target.type == "cpu":
            if self.normalize.active:  # with the batch: in the thread while it runs
                source = map(self._normalize_input, source)
            thread = ThreadStage(
                source,
                self.options.max_prefetch,
                reapable=reapable,
                limit=limit,
                produced=stats.produce.add,
                source_name=source_name,
            )
            return thread, thread
        streams = self._side_streams()
        if streams is not None and self.pin_host:
            source = map(self._pin, source)  # with the batch, as normalization on the CPU
        # While the thread runs, it makes and pins every batch (the caller waits for it); while
        # it is parked, the caller makes the batches the device stage copies ahead, as the
        # prefetchers of apex and timm do.
        thread = ThreadStage(
            source,
            self.options.max_prefetch,
            device=self.target,
            reapable=reapable,
            limit=limit,
            produced=stats.produce.add,
            source_name=source_name,
        )
        device = DeviceStage(
            thread,
            self.target,
            copies=streams if streams is not None else Copies(self.target),
            streams=streams,
            normalize=self.normalize,
            input_key=self.options.input_key,
            device_prefetch=self.options.device_prefetch,
            non_blocking=self.options.non_blocking,
            stats=stats,
        )
        return thread, device

    def _normalize_input(self, batch: Any) -> Any:
        return map_input(batch, self.options.input_key, self.normalize)

    def _pin(self, batch: Any) -> Any:
        """``batch`` with every CPU tensor leaf in page-locked memory.

        A copy from pageable memory cannot be asynchronous: the driver stages it, and behind the
        side stream's fence the host may wait for the caller's queued work. DataLoader's own
        ``pin_memory`` skips some batches (dataclasses) and needs CPU tensors; this pins every
        CPU leaf, whatever the batch's structure, and leaves the rest. A leaf pinned already
        (by the user) comes back as it is: ``pin_memory`` checks that itself, so asking first
        would only cost a second call per leaf.
        """
        streams = self._streams
        assert streams is not None  # only built over a CUDA target

        def pin(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type != "cpu" or streams.is_local(tensor):
                return tensor
            return streams.pin(tensor)

        return map_tensors(batch, pin)

    def _side_streams(self) -> CudaStreams | None:
        """The target's side stream, made once; ``None`` where copies are blocking."""
        if self.target.type != "cuda":
            return None  # MPS corrupts non_blocking copies (pytorch #83015); others: no streams
        if self._streams is None:
            self._streams = CudaStreams(self.target)
        return self._streams

    def __getstate__(self) -> dict[str, Any]:
        # A copied or pickled loader (in another process, say) takes its own current device and
        # makes its own side stream when it first needs them, and measures its own pace.
        return {**self.__dict__, "_target": None, "_streams": None, "decision": Decision()}
