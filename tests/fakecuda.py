"""A CPU model of CUDA streams and PyTorch's two caching allocators, for testing the device stage.

`FakeCuda` implements the stream operations the device stage uses (the interface its real
counterpart wraps around ``torch.cuda``) and models what they do, so that a test on a machine
without a GPU can tell a correct stage from one that races. "Device" tensors are ordinary CPU
tensors the model has tagged as living on the device; their values are computed at once, and the
model keeps track of when each access would have run on a real GPU.

What it models, and the PyTorch source each part follows:

* **Streams** are queues of work that complete only when a test says so (`FakeCuda.complete`,
  `FakeCuda.complete_all`): a test that completes nothing is a slow consumer. A stream cannot
  complete past a wait for work of another stream that has not completed. `done` and
  `elapsed_s` read completion and a device clock that the test moves with `advance`.
* **Ordering** follows ``torch/cuda/_sanitizer.py`` (CSAN): every stream carries a vector clock
  (the position of every other stream's work it is ordered after), events snapshot it, a wait
  merges it, and a host synchronization merges a stream's clock into every stream. An access
  that is not ordered after a conflicting access of another stream (read after write, write
  after read or write) is an **ordering hazard**. Which arguments an op reads or writes comes
  from its schema's alias annotations, as in CSAN's ``ArgumentHandler``; ``new_*``/``*_like``
  factories only read metadata.
* **Device memory** follows ``c10/cuda/CUDACachingAllocator.cpp``: a block belongs to the stream
  it was allocated on, and can be reallocated only on that stream. On free, a block with no
  ``stream_uses`` goes back to its stream's pool at once (``free_block``); ``recordStream``
  ignores the allocation stream and otherwise adds the stream to ``stream_uses``, and then
  ``free`` records an event on each of those streams at free time (``insert_events``) and the
  block is reusable only once they have completed (``process_events``, run by ``malloc``).
  Small requests (up to 1 MiB, after rounding to 512 bytes) and large ones use separate pools.
  A **reuse hazard** is recorded when an allocation on a stream may reuse a block freed on it
  while another stream still has an access to it queued that neither completed, nor is covered
  by a `protect` (``record_stream``) for that stream made before the free, nor is ordered before
  the allocating stream's current work. Frees that leave such an access behind are also listed
  in `FakeCuda.unprotected_frees` when they happen, whether or not a reuse follows.
* **Host memory** follows ``aten/src/ATen/native/cuda/Copy.cu`` and ``CachingHostAllocator``:
  a ``non_blocking`` copy calls ``record_event`` on the host allocator, which protects the
  source only if that allocator made it (``record_event`` returns false for other memory, and
  the block's ``free`` records events and defers reuse until they complete). So a buffer from
  `pin` may be dropped while its copy is pending; a buffer the user pinned (`user_pinned`)
  must not be, nor may any host buffer be written while its copy is pending: either is a
  **host hazard**. A copy with ``non_blocking=False`` ends in ``memcpy_and_sync`` (a stream
  synchronize), and a ``non_blocking`` copy from pageable memory (or from a non-dense tensor,
  which ``copy_kernel_cuda`` first makes contiguous in pageable memory) makes the driver
  synchronize the stream before staging it (CUDA runtime docs, "API synchronization behavior"):
  both count in `FakeCuda.host_syncs`, and both complete the stream's queued work, as the host
  would have waited for it.

The model sees device work through a `TorchDispatchMode` that ``with fake:`` enters in the
calling thread only: the dispatch mode stack is thread-local
(``c10/core/impl/TorchDispatchModeTLS.cpp``: ``thread_local TorchDispatchModeTLS``), so ops run
by other threads, a producer thread's host work included, are not seen at all. The calls of the
interface itself (`copy`, `pin`, `protect`, ...) work from any thread.

What it does not model: device tensors report ``device == cpu``, so ``.to(x.device)``,
``.cuda()``, ``.cpu()``, ``.tolist()`` and factories with ``device=`` are invisible or no-ops
(the first device op that meets such a host tensor raises `ModelError`); kernels take no time;
one device only; no CUDA graphs, no ``cudaMallocAsync`` backend, no reserved or segment
accounting, no out-of-memory path (whose ``synchronize_and_free_events`` would sync); which
freed block an allocation gets is not chosen (any block of the stream's pool counts); accesses
are tracked per block, so disjoint views of one block written by two streams count as a
conflict; host writes are seen through tensor version counters only.

Example:
    >>> fake = FakeCuda()
    >>> with fake:
    ...     fake.side_waits_for(fake.consumer())
    ...     with fake.on_side(fake.consumer()):
    ...         x = fake.copy(fake.pin(torch.zeros(4, dtype=torch.uint8)), non_blocking=True)
    ...         y = (x.float() - 1) / 2
    ...     ready = fake.mark(fake.side)
    ...     fake.wait(fake.consumer(), ready)
    ...     fake.protect(y, fake.consumer())
    ...     z = y * 2
    >>> fake.hazards, fake.host_syncs, fake.done(ready)
    ([], 0, False)
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SMALL_SIZE = 1 << 20
"""Largest request served from the small pool (``kSmallSize``); larger ones use the large pool."""

MIN_BLOCK_SIZE = 512
"""Requests are rounded up to a multiple of this (``kMinBlockSize``)."""

_FACTORY = re.compile(r"(new_.*|.*_like)")  # CSAN's FACTORY_FUNCTION_REGEX

# Ops that make the host wait for the current stream: they return a device value to the host
# (``_local_scalar_dense`` is ``.item()``), or need the result size before they can allocate.
_SYNCING_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::equal",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
    }
)


class ModelError(RuntimeError):
    """Code under the model did what real CUDA refuses, or what the model cannot follow."""


class Stream:
    """A queue of device work in the model; nothing completes until a test completes it.

    Positions count work items from 1; ``queued`` is the last one queued and ``completed`` the
    last one completed. A stream compares by identity, as CUDA streams do by handle.
    """

    def __init__(self, name: str, clock: dict[Stream, int]) -> None:
        self.name = name
        self.queued = 0
        self.completed = 0
        # Position -> (stream, position) that this work item waits for.
        self._waits: dict[int, tuple[Stream, int]] = {}
        # Device clock reading at which each item completed, by position - 1.
        self._done_at: list[float] = []
        # The position of each stream's work that this stream's next work is ordered after.
        self._clock = clock
        self._clock[self] = 0

    def __repr__(self) -> str:
        return f"<Stream {self.name} queued={self.queued} completed={self.completed}>"


@dataclass(frozen=True, eq=False)
class Event:
    """An event recorded on ``stream`` after its first ``position`` work items."""

    stream: Stream
    position: int
    recorded_at: float
    _clock: dict[Stream, int] = field(repr=False)


@dataclass(eq=False)
class _Access:
    stream: Stream
    position: int
    write: bool
    op: str
    # What the op wrote: what a conflicting access would leave wrong (poisoned with `corrupt`).
    outs: tuple[weakref.ref[torch.Tensor], ...]

    def describe(self) -> str:
        verb = "wrote" if self.write else "read"
        return f"{self.stream.name} {verb} it in {self.op} ({self.stream.name}#{self.position})"


@dataclass(eq=False)
class _Block:
    owner: Stream
    nbytes: int
    uses: set[Stream] = field(default_factory=set)  # the allocator's stream_uses
    last_write: _Access | None = None
    reads: dict[Stream, _Access] = field(default_factory=dict)  # latest read since last write
    latest: dict[Stream, _Access] = field(default_factory=dict)  # latest access of any kind

    @property
    def small(self) -> bool:
        return _rounded(self.nbytes) <= SMALL_SIZE


@dataclass(eq=False)
class _Freed:
    """A freed block the model still follows: held by events, or not yet safe to reuse."""

    block: _Block
    events: dict[Stream, int]  # insert_events: stream -> position at free time
    unsafe: dict[Stream, _Access]  # accesses neither completed, protected nor ordered

    def ready(self) -> bool:
        return all(stream.completed >= pos for stream, pos in self.events.items())


@dataclass(eq=False)
class _HostRead:
    """A pending copy that reads a host buffer."""

    stream: Stream
    position: int
    pinned_by: str  # "allocator" or "user"
    nbytes: int
    source: weakref.ref[torch.Tensor]
    version: int
    copied: weakref.ref[torch.Tensor]


class _Mode(TorchDispatchMode):
    """Hands every op of the thread that entered it to the model."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in torch
        self.fake = fake

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.fake._dispatch(func, args, kwargs or {})


class FakeCuda:
    """A model of one CUDA device, its streams, and the device and host caching allocators.

    Implements the stream interface of the device stage (`consumer`, `on_side`,
    `side_waits_for`, `mark`, `wait`, `protect`, `done`, `elapsed_s`, `pin`, `is_local`,
    `copy`) and gives a test the controls and the findings: `complete`, `advance`, `use`,
    `hazards`, `unprotected_frees`, `host_syncs`, `device_bytes_live`.

    Drive the code under test inside ``with fake:`` so that its tensor ops are seen. Device
    memory is freed when the last tensor on a block dies, which is at once for plain references
    and at the next garbage collection for reference cycles.

    Args:
        corrupt: Make hazards visible in values too: what an unordered or reused access would
            have left wrong is overwritten with all-ones bytes (NaN for floating types) where the
            tensor is still alive.

    Attributes:
        default: The stream every thread starts on.
        side: The side stream of `on_side`.
        unprotected_frees: One line per block freed while another stream may still use it
            without a `protect` for that stream.
        host_syncs: How many times the host waited for a stream (blocking copies, pageable
            ``non_blocking`` copies, ``.item()`` and the like); ``host_sync_reasons`` says why.
        host_ops: Ops seen under the mode that touched no device tensor (host work in the
            calling thread).
        device_bytes_peak: The largest `device_bytes_live` seen at an allocation.
        now: The device clock, in seconds; see `advance`.
    """

    def __init__(self, *, corrupt: bool = False) -> None:
        self.corrupt = corrupt
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._host_clock: dict[Stream, int] = {}
        self._streams: list[Stream] = []
        self._hazards: list[str] = []
        self.unprotected_frees: list[str] = []
        self.host_syncs = 0
        self.host_sync_reasons: list[str] = []
        self.host_ops: list[str] = []
        self.device_bytes_peak = 0
        self.now = 0.0
        self._blocks: dict[int, _Block] = {}  # id(storage) -> block, for live device storages
        self._freed: list[_Freed] = []
        self._pinned: dict[int, str] = {}  # id(storage) -> "allocator" or "user"
        self._host_reads: dict[int, list[_HostRead]] = {}  # id(host storage) -> pending copies
        self.default = self.new_stream("default")
        self.side = self.new_stream("side")

    # ----------------------------------------------------------------- the stage's interface

    def consumer(self) -> Stream:
        """The calling thread's current stream (`default` unless `use` or `on_side` says else)."""
        stream: Stream = getattr(self._tls, "stream", self.default)
        return stream

    @contextlib.contextmanager
    def on_side(self, consumer: Stream) -> Iterator[None]:
        """Context in which the calling thread's work is queued on `side`; on leaving,
        ``consumer`` is current again, as the real one sets it back (it must be the current
        stream at entry: `ModelError` otherwise, since the real one would then leave the caller
        on a stream it never chose)."""
        if consumer is not self.consumer():
            raise ModelError(
                f"on_side(consumer={consumer.name!r}) while the current stream is "
                f"{self.consumer().name!r}"
            )
        self._tls.stream = self.side
        try:
            yield
        finally:
            self._tls.stream = consumer

    def side_waits_for(self, stream: Stream) -> None:
        """Queue, on `side`, a wait for all work queued so far on ``stream``."""
        if stream is not self.side:
            self.wait(self.side, self.mark(stream))

    def mark(self, stream: Stream, timing: bool = False) -> Event:
        """An event recorded on ``stream`` after the work queued so far (every event times)."""
        with self._lock:
            return Event(stream, stream.queued, self.now, dict(stream._clock))

    def wait(self, stream: Stream, event: Event) -> None:
        """Queue, on ``stream``, a wait for ``event``."""
        with self._lock:
            if event.stream is stream:
                return  # a stream is ordered after its own work already
            _merge(stream._clock, event._clock)
            self._queue(stream, waits_for=(event.stream, event.position))

    def protect(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor.record_stream(stream)``: keep its block from reuse until ``stream``'s work
        queued by the time of the free is done.

        Raises:
            NotImplementedError: ``tensor`` is sparse; ``record_stream`` reads ``storage()``,
                which a sparse tensor does not have. Protect its indices and values instead.
            RuntimeError: ``tensor`` is not on the device (``record_stream`` has no CPU kernel).
        """
        if tensor.layout != torch.strided:
            raise NotImplementedError(f"Cannot access storage of {_impl_name(tensor)}")
        with self._lock, self._quiet():
            block = self._blocks.get(id(tensor.untyped_storage()))
            if block is None:
                raise RuntimeError("record_stream: the tensor is not on the device")
            if stream is not block.owner:  # recordStream ignores the allocation stream
                block.uses.add(stream)

    def done(self, event: Event) -> bool:
        """``event.query()``: whether the work before ``event`` has completed. Never blocks.

        Seeing it completed orders the host's later work after it, as a real query does.
        """
        with self._lock:
            if event.stream.completed < event.position:
                return False
            self._host_observed(event._clock)
            return True

    def elapsed_s(self, start: Event, end: Event) -> float:
        """Seconds of device clock between ``start`` and ``end``, once both have completed.

        Raises:
            RuntimeError: Either event has not completed ("device not ready", as CUDA says).
        """
        with self._lock:
            for event in (start, end):
                if event.stream.completed < event.position:
                    raise RuntimeError(
                        f"CUDA error: device not ready (an event on {event.stream.name} at "
                        f"{event.stream.name}#{event.position} has not completed)"
                    )
            return _time(end) - _time(start)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` from the caching host allocator (``tensor.pin_memory()``).

        A tensor that is pinned already is returned as it is, as ``pin_memory`` does.

        Raises:
            RuntimeError: ``tensor`` is on the device ("only dense CPU tensors can be pinned").
        """
        with self._lock, self._quiet():
            if self.is_local(tensor):
                raise RuntimeError(
                    f"cannot pin '{_type_name(tensor)}' only dense CPU tensors can be pinned"
                )
            if self.is_pinned(tensor):
                return tensor
            pinned = tensor.clone()
            for part in _parts(pinned):
                self._tag_host(part, "allocator")
            return pinned

    def is_local(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device."""
        with self._lock, self._quiet():
            return all(id(p.untyped_storage()) in self._blocks for p in _parts(tensor))

    def copy(self, tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """``tensor.to(device, non_blocking=...)`` on the calling thread's current stream.

        The result is allocated on the current stream and written there; the source is read
        there. A tensor already on the device is returned as it is. A copy that makes the host
        wait (``non_blocking=False``, or from memory that is not pinned, or from a pinned but
        non-dense tensor) counts in `host_syncs` and completes the stream's queued work.
        """
        with self._lock, self._quiet():
            if self.is_local(tensor):
                return tensor
            if tensor.device.type != "cpu":
                raise ModelError(f"copy() takes host tensors, got one on {tensor.device}")
            stream = self.consumer()
            parts = _parts(tensor)
            kinds = {self._pinned.get(id(p.untyped_storage())) for p in parts}
            pinned = None not in kinds
            dense = all(_dense(p) for p in parts)
            asynchronous = non_blocking and pinned and dense
            if non_blocking and not asynchronous:
                why = "pageable memory" if not pinned else "a non-dense tensor (made contiguous)"
                self._host_sync(stream, f"non_blocking copy from {why} on {stream.name}")
            copied = tensor.clone()
            self._device_op(stream, "copy()", reads=[], writes=[], new=_parts(copied))
            if asynchronous:
                self._add_host_reads(tensor, parts, copied, stream)
            if not non_blocking:
                self._host_sync(stream, f"blocking copy on {stream.name}")
            return copied

    # --------------------------------------------------------------------- test controls

    def __enter__(self) -> FakeCuda:
        mode = _Mode(self)
        mode.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
        self._tls.__dict__.setdefault("modes", []).append(mode)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._tls.modes.pop().__exit__(*exc_info)

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """Make ``stream`` the calling thread's current stream inside the context."""
        before = self.consumer()
        self._tls.stream = stream
        try:
            yield
        finally:
            self._tls.stream = before

    def new_stream(self, name: str) -> Stream:
        """Another stream, ordered after what the host has seen complete so far."""
        with self._lock:
            stream = Stream(name, dict(self._host_clock))
            self._streams.append(stream)
            return stream

    def complete(self, stream: Stream, upto: int | Event | None = None) -> int:
        """Let ``stream``'s work complete, up to position or event ``upto`` (default: all).

        Stops early at a wait for work of another stream that has not completed.

        Returns:
            The position completed now.
        """
        with self._lock:
            if isinstance(upto, Event):
                if upto.stream is not stream:
                    raise ValueError(f"`upto` is an event on {upto.stream.name}, not {stream.name}")
                upto = upto.position
            target = stream.queued if upto is None else upto
            if not 0 <= target <= stream.queued:
                raise ValueError(
                    f"`upto` must be a position from 0 to {stream.queued} on {stream.name}, "
                    f"got {target}."
                )
            self._check_host_reads()
            while stream.completed < target:
                waited = stream._waits.get(stream.completed + 1)
                if waited is not None and waited[0].completed < waited[1]:
                    break
                self._complete_one(stream)
            self._check_host_reads()
            return stream.completed

    def complete_all(self) -> None:
        """Let every stream's queued work complete."""
        with self._lock:
            progress = True
            while progress:
                progress = False
                for stream in self._streams:
                    before = stream.completed
                    progress |= self.complete(stream) != before

    def advance(self, seconds: float) -> None:
        """Move the device clock on; work completed afterwards completes at the new time."""
        if seconds < 0:
            raise ValueError(f"`seconds` must be >= 0, got {seconds}.")
        with self._lock:
            self.now += seconds

    def user_pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark ``tensor`` as pinned by its user (not by the caching host allocator); return it.

        `copy` treats it as pinned, so ``non_blocking`` copies are asynchronous, but nothing
        keeps it alive or unchanged while they are pending.
        """
        with self._lock, self._quiet():
            if self.is_local(tensor):
                raise RuntimeError(
                    f"cannot pin '{_type_name(tensor)}' only dense CPU tensors can be pinned"
                )
            for part in _parts(tensor):
                self._tag_host(part, "user")
            return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory pinned by `pin` or marked by `user_pinned`."""
        with self._lock, self._quiet():
            return all(id(p.untyped_storage()) in self._pinned for p in _parts(tensor))

    def on_device(self, values: torch.Tensor) -> torch.Tensor:
        """A device tensor holding ``values``, made by a kernel on the current stream.

        For tests that need a tensor the caller's code made on the device (a GPU-resident
        dataset, a loader that already places batches): no copy, no host sync.
        """
        with self._lock, self._quiet():
            made = values.clone()
            self._device_op(self.consumer(), "on_device", reads=[], writes=[], new=_parts(made))
            return made

    @property
    def hazards(self) -> list[str]:
        """One line per hazard found so far: ``ordering hazard: ...``, ``reuse hazard: ...``
        or ``host hazard: ...``."""
        with self._lock:
            self._check_host_reads()
            return self._hazards

    @property
    def device_bytes_live(self) -> int:
        """Bytes of device blocks not reusable now: live ones, and freed ones that events of
        `protect`-ed streams still hold."""
        with self._lock:
            live = sum(block.nbytes for block in list(self._blocks.values()))
            return live + sum(f.block.nbytes for f in self._freed if not f.ready())

    # ----------------------------------------------------------------------- the model

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """The model's own tensor ops, which the mode must pass through unseen."""
        self._tls.quiet = getattr(self._tls, "quiet", 0) + 1
        try:
            yield
        finally:
            self._tls.quiet -= 1

    def _queue(self, stream: Stream, waits_for: tuple[Stream, int] | None = None) -> int:
        stream.queued += 1
        stream._clock[stream] = stream.queued
        if waits_for is not None:
            stream._waits[stream.queued] = waits_for
        return stream.queued

    def _complete_one(self, stream: Stream) -> None:
        stream.completed += 1
        stream._done_at.append(self.now)

    def _host_sync(self, stream: Stream, reason: str) -> None:
        """The host waits until ``stream``'s queued work is done; later work is ordered after."""
        self.host_syncs += 1
        self.host_sync_reasons.append(reason)
        self._check_host_reads()
        _drain(stream, stream.queued, self._complete_one)
        self._host_observed(stream._clock)
        self._check_host_reads()

    def _host_observed(self, clock: dict[Stream, int]) -> None:
        """The host knows the work in ``clock`` is done: what it queues next is ordered after."""
        _merge(self._host_clock, clock)
        for stream in self._streams:
            _merge(stream._clock, clock)

    def _hazard(self, line: str, poison: list[weakref.ref[torch.Tensor]] | None = None) -> None:
        self._hazards.append(line)
        if self.corrupt and poison:
            with self._quiet():
                for ref in poison:
                    tensor = ref()
                    if tensor is not None:
                        for part in _parts(tensor):
                            storage: Any = part.untyped_storage()  # fill_ is untyped
                            storage.fill_(0xFF)

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if getattr(self._tls, "quiet", 0):
            return func(*args, **kwargs)
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        if func is aten._pin_memory.default:
            return self.pin(args[0])
        with self._lock:
            schema = func._schema
            op = str(func)
            metadata_only = bool(_FACTORY.match(schema.name))
            reads: list[torch.Tensor] = []
            writes: list[torch.Tensor] = []
            inputs: list[torch.Tensor] = []
            host: list[torch.Tensor] = []
            # Indexing with a boolean mask sizes its result with nonzero(), which syncs.
            syncs = schema.name in _SYNCING_OPS
            for argument, value in _arguments(schema, args, kwargs):
                alias = argument.alias_info
                is_write = alias is not None and alias.is_write
                view_only = metadata_only or (alias is not None and not is_write)
                for leaf in pytree.tree_leaves(value):
                    if not isinstance(leaf, torch.Tensor):
                        continue
                    syncs |= argument.name == "indices" and leaf.dtype in (torch.bool, torch.uint8)
                    for part in _parts(leaf):
                        inputs.append(part)
                        if id(part.untyped_storage()) not in self._blocks:
                            # A 0-dim CPU tensor is a scalar to a CUDA kernel, read at launch.
                            if leaf.dim() != 0 or is_write:
                                host.append(leaf)
                        elif not view_only:
                            (writes if is_write else reads).append(part)
            if not any(id(p.untyped_storage()) in self._blocks for p in inputs):
                self.host_ops.append(op)
                return func(*args, **kwargs)
            if host:
                shapes = ", ".join(str(tuple(t.shape)) for t in host)
                raise ModelError(
                    f"{op} got host tensors of shape {shapes} beside device tensors: a device "
                    "op read host memory. On a GPU that raises 'Expected all tensors to be on "
                    "the same device'; here it usually means a tensor went to the device by "
                    ".to(x.device), .cuda() or a factory's device=, which the model cannot see "
                    "(its device tensors report device cpu). Move host tensors with copy()."
                )
            stream = self.consumer()
            result = func(*args, **kwargs)
            leaves = pytree.tree_leaves(result)
            if not syncs and not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
                return result  # metadata (sizes, nnz, ...): no kernel, no access
            seen = {id(p.untyped_storage()) for p in inputs}
            new: list[torch.Tensor] = []
            outs: list[torch.Tensor] = list(writes)
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    continue
                outs.append(leaf)
                for part in _parts(leaf):
                    key = id(part.untyped_storage())
                    if key in seen:
                        continue  # a view of an input, or the input written in place
                    seen.add(key)
                    if key in self._blocks:
                        writes.append(part)
                    else:
                        new.append(part)
            self._device_op(stream, op, reads=reads, writes=writes, new=new, outs=outs)
            if syncs:
                self._host_sync(stream, f"{op} on {stream.name} returns a device value to the host")
            return result

    def _device_op(
        self,
        stream: Stream,
        op: str,
        *,
        reads: list[torch.Tensor],
        writes: list[torch.Tensor],
        new: list[torch.Tensor],
        outs: list[torch.Tensor] | None = None,
    ) -> None:
        """Queue one work item on ``stream`` that reads, writes and allocates these tensors."""
        written = {id(p.untyped_storage()): p for p in writes}
        read = {id(p.untyped_storage()): p for p in reads if id(p.untyped_storage()) not in written}
        if not (read or written or new):
            return
        for part in new:
            self._may_reuse(stream, part, op)
        position = self._queue(stream)
        refs = tuple(weakref.ref(t) for t in (outs if outs is not None else new))
        for key in read:
            self._access(self._blocks[key], _Access(stream, position, False, op, refs))
        for key in written:
            self._access(self._blocks[key], _Access(stream, position, True, op, refs))
        for part in new:
            block = self._allocate(part, stream)
            self._access(block, _Access(stream, position, True, op, refs))
        self.device_bytes_peak = max(self.device_bytes_peak, self.device_bytes_live)

    def _access(self, block: _Block, access: _Access) -> None:
        """Record ``access`` to ``block``, checking it against earlier ones as CSAN does."""
        stream = access.stream
        earlier: list[_Access | None]
        if access.write:
            earlier = [*block.reads.values()] or [block.last_write]
            block.last_write, block.reads = access, {}
        else:
            earlier = [block.last_write]
            block.reads[stream] = access
        block.latest[stream] = access
        for previous in earlier:
            if previous is None or _ordered(stream, previous):
                continue
            verb = "writes" if access.write else "reads"
            self._hazard(
                f"ordering hazard: {stream.name} {verb} a block of {block.owner.name} in "
                f"{access.op} ({stream.name}#{access.position}) while {previous.describe()}, "
                f"and {stream.name} has not waited for that",
                poison=[*access.outs, *(previous.outs if access.write else ())],
            )

    def _allocate(self, part: torch.Tensor, stream: Stream) -> _Block:
        storage = part.untyped_storage()
        key = id(storage)
        block = _Block(owner=stream, nbytes=storage.nbytes())
        self._blocks[key] = block
        weakref.finalize(storage, self._device_free, key).atexit = False
        return block

    def _device_free(self, key: int) -> None:
        """The last tensor on a device block died: ``DeviceCachingAllocator::free``."""
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is None:
                return
            owner = block.owner
            unsafe: dict[Stream, _Access] = {}
            for stream, access in block.latest.items():
                if stream is owner or stream in block.uses or not _pending(access, owner):
                    continue
                unsafe[stream] = access
                verb = "write" if access.write else "read"
                self.unprotected_frees.append(
                    f"unprotected free: block of {owner.name} ({block.nbytes} bytes) freed while "
                    f"{stream.name} may still {verb} it ({access.op}, "
                    f"{stream.name}#{access.position}) without protect(tensor, {stream.name})"
                )
            events = {stream: stream.queued for stream in block.uses}
            freed = _Freed(block, events, unsafe)
            if unsafe or not freed.ready():
                self._freed.append(freed)

    def _may_reuse(self, stream: Stream, part: torch.Tensor, op: str) -> None:
        """Allocating ``part`` on ``stream`` may get any ready block of its stream's pool (of
        any size: free neighbours coalesce): check those another stream may still use."""
        small = _rounded(part.untyped_storage().nbytes()) <= SMALL_SIZE
        kept: list[_Freed] = []
        for freed in self._freed:
            block = freed.block
            for other, access in list(freed.unsafe.items()):
                if not _pending(access, block.owner):
                    del freed.unsafe[other]
                elif block.owner is stream and block.small == small and freed.ready():
                    del freed.unsafe[other]
                    verb = "write" if access.write else "read"
                    self._hazard(
                        f"reuse hazard: block of {block.owner.name} ({block.nbytes} bytes) freed "
                        f"while {other.name} may still {verb} it ({access.op}, "
                        f"{other.name}#{access.position}, not complete, not protected, and "
                        f"{block.owner.name} has not waited for it); {op} on {stream.name} may "
                        "reuse it",
                        # A pending read sees the new data; a pending write spoils it.
                        poison=[weakref.ref(part)] if access.write else list(access.outs),
                    )
            if freed.unsafe or not freed.ready():
                kept.append(freed)
        self._freed = kept

    def _tag_host(self, part: torch.Tensor, kind: str) -> None:
        storage = part.untyped_storage()
        key = id(storage)
        if key not in self._pinned:
            weakref.finalize(storage, self._pinned.pop, key, None).atexit = False
        self._pinned[key] = kind

    def _add_host_reads(
        self,
        source: torch.Tensor,
        parts: list[torch.Tensor],
        copied: torch.Tensor,
        stream: Stream,
    ) -> None:
        for part in parts:
            storage = part.untyped_storage()
            key = id(storage)
            if key not in self._host_reads:
                self._host_reads[key] = []
                weakref.finalize(storage, self._host_free, key).atexit = False
            self._host_reads[key].append(
                _HostRead(
                    stream=stream,
                    position=stream.queued,
                    pinned_by=self._pinned[key],
                    nbytes=storage.nbytes(),
                    source=weakref.ref(source),
                    version=source._version,
                    copied=weakref.ref(copied),
                )
            )

    def _host_free(self, key: int) -> None:
        """A host buffer read by copies died; only the host allocator's own blocks wait."""
        with self._lock:
            for read in self._host_reads.pop(key, []):
                if read.stream.completed >= read.position or read.pinned_by == "allocator":
                    continue
                self._hazard(
                    f"host hazard: a user-pinned host buffer ({read.nbytes} bytes) was freed "
                    f"while its copy on {read.stream.name} ({read.stream.name}#{read.position}) "
                    "was pending; the caching host allocator protects only its own blocks",
                    poison=[read.copied],
                )

    def _check_host_reads(self) -> None:
        """Find host buffers written while their copies are pending; forget completed copies."""
        for key, reads in list(self._host_reads.items()):
            pending: list[_HostRead] = []
            for read in reads:
                source = read.source()
                if source is not None and source._version != read.version:
                    read.version = source._version
                    self._hazard(
                        f"host hazard: a host buffer ({read.nbytes} bytes) was written while its "
                        f"copy on {read.stream.name} ({read.stream.name}#{read.position}) was "
                        "pending",
                        poison=[read.copied],
                    )
                if read.stream.completed < read.position:
                    pending.append(read)
            self._host_reads[key] = pending


def _arguments(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    """(schema argument, value) pairs, as CSAN's ``zip_arguments`` makes them."""
    yield from zip(schema.arguments, args, strict=False)  # args never outnumber them
    by_name = {argument.name: argument for argument in schema.arguments[len(args) :]}
    for name, value in kwargs.items():
        if name in by_name:
            yield by_name[name], value


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors that hold ``tensor``'s memory: itself, or a sparse tensor's parts."""
    layout = tensor.layout
    if layout == torch.strided:
        return [tensor]
    if layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    raise ModelError(f"the model does not know tensors of layout {layout}")


def _dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: ``copy_kernel_cuda`` copies it without a host temporary."""
    if tensor.is_contiguous():
        return True
    expected = 1
    layout = sorted(
        (st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1
    )
    for stride, size in layout:
        if stride != expected:
            return False
        expected *= size
    return True


def _rounded(nbytes: int) -> int:
    return max(MIN_BLOCK_SIZE, -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)


def _merge(clock: dict[Stream, int], other: dict[Stream, int]) -> None:
    for stream, position in other.items():
        if clock.get(stream, 0) < position:
            clock[stream] = position


def _ordered(stream: Stream, access: _Access) -> bool:
    """Whether ``stream``'s next work is ordered after ``access``."""
    return access.stream is stream or stream._clock.get(access.stream, 0) >= access.position


def _pending(access: _Access, owner: Stream) -> bool:
    """Whether ``access`` may still run when ``owner`` reuses the block now."""
    return access.stream.completed < access.position and not _ordered(owner, access)


def _drain(stream: Stream, target: int, complete_one: Callable[[Stream], None]) -> None:
    """Complete ``stream`` up to ``target``, and first whatever its waits wait for."""
    while stream.completed < target:
        waited = stream._waits.get(stream.completed + 1)
        if waited is not None:
            _drain(waited[0], waited[1], complete_one)
        complete_one(stream)


def _time(event: Event) -> float:
    """When ``event`` completed: when the work before it did, or when it was recorded."""
    if event.position == 0:
        return event.recorded_at
    return max(event.recorded_at, event.stream._done_at[event.position - 1])


def _impl_name(tensor: torch.Tensor) -> str:
    if tensor.layout == torch.sparse_coo:
        return "SparseTensorImpl"
    return "SparseCsrTensorImpl"


def _type_name(tensor: torch.Tensor) -> str:
    return tensor.type().replace("torch.", "torch.cuda.", 1)
