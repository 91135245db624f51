"""The resume state as plain data: its fields, their checks, and random generator states as ints.

A state is a dict of Python ints, bools, strings, lists, dicts and ``None`` (plus whatever a
dataset's own ``state_dict()`` returns), so that it survives ``torch.save`` with
``torch.load(weights_only=True)``, a JSON round trip, and comparison with ``==``. A random
generator's state is the list of the ints of its bytes; Python's and numpy's global generators
keep their own ``getstate()`` layout, tuples as lists.

`Saved.from_state` checks every field of a state, and every combination of fields, against what
a real state can hold; each error names the field and the value.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

FORMAT = "prefetchx.DataLoaderX"
VERSION = 3
FIELDS = (
    "loader",
    "epoch_in_progress",
    "consumed",
    "rng_states_at_iter",
    "rng_states",
    "rng_seed",
    "digest",
    "base_seed_next",
    "dataset_state",
    "iterator_state",
    "ended",
    "num_workers",
    "workers",
    "next_worker",
    "fast_forward",
)
WORKER_FIELDS = ("rng", "dataset_state", "iterator_state", "ended", "drain")
RNG_FIELDS = ("torch", "random", "numpy")

States = list[torch.Tensor | None]
"""One state per generator of `random_generators`; ``None`` leaves that generator alone."""


@dataclass(frozen=True)
class WorkerState:
    """What one worker process was at after the last batch of it the loop received.

    ``rng`` holds its global random generators (`RNG_FIELDS`) as plain data; ``drain`` says that
    its dataset's iteration ended after that batch (persistent workers between epochs), so the
    resumed worker runs the restored iterator to its end before the next epoch.
    """

    rng: dict[str, Any] | None = None
    dataset_state: Any = None
    iterator_state: Any = None
    ended: bool = False
    drain: bool = False

    def to_state(self) -> dict[str, Any]:
        return {
            "rng": self.rng,
            "dataset_state": self.dataset_state,
            "iterator_state": self.iterator_state,
            "ended": self.ended,
            "drain": self.drain,
        }


@dataclass(frozen=True)
class Saved:
    """A checked state, waiting for the loader's next epoch.

    Generator states are tensors here (`torch.Generator.set_state` takes them); everything else
    is as in the state. See `DataLoaderX.state_dict` for what each field means.
    """

    in_epoch: bool
    consumed: int
    at_iter: States
    at_draw: States
    seed_at: torch.Tensor | None = None
    digest: int | None = None
    base_seed_next: bool = True
    dataset_state: Any = None
    iterator_state: Any = None
    ended: bool = False
    num_workers: int = 0
    workers: tuple[WorkerState | None, ...] | None = None
    next_worker: int = 0
    fast_forward: bool = False

    def to_state(self, loader: dict[str, Any]) -> dict[str, Any]:
        """The state as plain data, for the loader that `describe` described."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "loader": loader,
            "epoch_in_progress": self.in_epoch,
            "consumed": self.consumed,
            "rng_states_at_iter": _plain_states(self.at_iter),
            "rng_states": _plain_states(self.at_draw),
            "rng_seed": None if self.seed_at is None else plain_generator_state(self.seed_at),
            "digest": self.digest,
            "base_seed_next": self.base_seed_next,
            "dataset_state": self.dataset_state,
            "iterator_state": self.iterator_state,
            "ended": self.ended,
            "num_workers": self.num_workers,
            "workers": (
                None
                if self.workers is None
                else [None if w is None else w.to_state() for w in self.workers]
            ),
            "next_worker": self.next_worker,
            "fast_forward": self.fast_forward,
        }

    @classmethod
    def from_state(
        cls,
        state: object,
        loader: dict[str, Any],
        generators: Sequence[torch.Generator],
    ) -> Saved:
        """Check every field of ``state``, and how they go together, against this loader.

        Raises:
            TypeError: ``state`` is not a DataLoaderX state.
            ValueError: A field is missing or malformed, fields contradict each other (no real
                state holds them together), or the state comes from another loader; the error
                names the field and its value.
        """
        fields = _checked_header(state, loader)
        in_epoch = _bool(fields, "epoch_in_progress")
        consumed = _count(fields, "consumed")
        num_workers = _count(fields, "num_workers")
        workers = _workers(fields, num_workers)
        saved = cls(
            in_epoch=in_epoch,
            consumed=consumed,
            at_iter=_states(fields, "rng_states_at_iter", generators),
            at_draw=_states(fields, "rng_states", generators),
            seed_at=_seed(fields, generators),
            digest=_digest(fields),
            base_seed_next=_bool(fields, "base_seed_next"),
            dataset_state=fields["dataset_state"],
            iterator_state=fields["iterator_state"],
            ended=_bool(fields, "ended"),
            num_workers=num_workers,
            workers=workers,
            next_worker=_count(fields, "next_worker"),
            fast_forward=_bool(fields, "fast_forward"),
        )
        _check_together(saved, loader)
        return saved


def plain_generator_state(state: torch.Tensor) -> list[int]:
    """A `torch.Generator` state as the list of its bytes."""
    return state.tolist()


def generator_state(value: list[int]) -> torch.Tensor:
    """The `torch.Generator` state that `plain_generator_state` gave as a list."""
    return torch.tensor(value, dtype=torch.uint8)


def _plain_states(states: States) -> list[list[int] | None]:
    return [None if s is None else plain_generator_state(s) for s in states]


def _checked_header(state: object, loader: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise TypeError(f"`state` must be a dict from DataLoaderX.state_dict(), got {got!r}.")
    if state.get("version") != VERSION:
        raise ValueError(
            f"`state` has version {state.get('version')!r}; this prefetchx reads version "
            f"{VERSION}. A state of another version cannot resume exactly here: start the "
            "epoch afresh (do not load it), or resume with the prefetchx that saved it."
        )
    missing = [name for name in FIELDS if name not in state]
    if missing:
        raise ValueError(f"`state` lacks {', '.join(missing)}: is it a whole state_dict()?")
    unknown = sorted(str(name) for name in state.keys() - {"format", "version", *FIELDS})
    if unknown:
        raise ValueError(f"`state` has fields no DataLoaderX state has: {', '.join(unknown)}.")
    theirs = state["loader"]
    if not isinstance(theirs, dict):
        raise ValueError(f"`state['loader']` must be a dict, got {theirs!r}.")
    differ = sorted(k for k in loader.keys() | theirs.keys() if loader.get(k) != theirs.get(k))
    if differ:
        detail = "; ".join(f"{k} {theirs.get(k)!r} there, {loader.get(k)!r} here" for k in differ)
        raise ValueError(f"`state` comes from a different loader: {detail}.")
    return state


def _bool(state: dict[str, Any], name: str) -> bool:
    value = state[name]
    if not isinstance(value, bool):
        raise ValueError(f"`state['{name}']` must be a bool, got {value!r}.")
    return value


def _count(state: dict[str, Any], name: str) -> int:
    value = state[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`state` has {name}={value!r}; it must be an int >= 0.")
    return value


def _digest(state: dict[str, Any]) -> int | None:
    value = state["digest"]
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32
    ):
        raise ValueError(
            f"`state['digest']` must be None or a 32-bit checksum (an int from 0 to 2**32 - 1), "
            f"got {value!r}."
        )
    return value


def _states(state: dict[str, Any], name: str, generators: Sequence[torch.Generator]) -> States:
    values = state[name]
    if not isinstance(values, list):
        raise ValueError(f"`state['{name}']` must be a list of generator states, got {values!r}.")
    if len(values) != len(generators):
        raise ValueError(
            f"`state['{name}']` holds {len(values)} random generator states; this loader's "
            f"sampler draws from {len(generators)}."
        )
    return [
        None if value is None else _generator_state(f"state['{name}'][{i}]", value, generator)
        for i, (value, generator) in enumerate(zip(values, generators, strict=True))
    ]


def _seed(state: dict[str, Any], generators: Sequence[torch.Generator]) -> torch.Tensor | None:
    value = state["rng_seed"]
    return None if value is None else _generator_state("state['rng_seed']", value, generators[0])


def _generator_state(where: str, value: object, generator: torch.Generator) -> torch.Tensor:
    """Refuse now what ``generator.set_state`` would refuse at the next ``iter()``."""
    if not _ints(value, 0, 255):
        raise ValueError(
            f"`{where}` must be a generator state as a list of ints from 0 to 255 "
            f"(torch.Generator.get_state().tolist()), got {_short(value)}."
        )
    tensor = generator_state(value)
    probe = torch.Generator(device=generator.device)
    try:
        probe.set_state(tensor)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"`{where}` is not a state of a {generator.device} random generator: {exc}"
        ) from None
    return tensor


def _workers(state: dict[str, Any], num_workers: int) -> tuple[WorkerState | None, ...] | None:
    values = state["workers"]
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != num_workers:
        raise ValueError(
            f"`state['workers']` must be None or a list of {num_workers} worker states (one per "
            f"worker of num_workers={num_workers}), got {_short(values)}."
        )
    return tuple(_worker(f"state['workers'][{i}]", value) for i, value in enumerate(values))


def _worker(where: str, value: object) -> WorkerState | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(WORKER_FIELDS):
        raise ValueError(
            f"`{where}` must be None or a dict of {', '.join(WORKER_FIELDS)}, got {_short(value)}."
        )
    for name in ("ended", "drain"):
        if not isinstance(value[name], bool):
            raise ValueError(f"`{where}['{name}']` must be a bool, got {value[name]!r}.")
    rng = value["rng"]
    if rng is not None:
        check_worker_rng(f"{where}['rng']", rng)
    return WorkerState(
        rng=rng,
        dataset_state=value["dataset_state"],
        iterator_state=value["iterator_state"],
        ended=value["ended"],
        drain=value["drain"],
    )


def check_worker_rng(where: str, rng: object) -> None:
    """Refuse a worker's random states that its generators would refuse when it starts."""
    if not isinstance(rng, dict) or set(rng) != set(RNG_FIELDS):
        raise ValueError(
            f"`{where}` must be a dict of {', '.join(RNG_FIELDS)} states, got {_short(rng)}."
        )
    _generator_state(f"{where}['torch']", rng["torch"], torch.default_generator)
    python = rng["random"]
    try:
        random.Random().setstate(python_random_state(python))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"`{where}['random']` is not a state of Python's random module ({exc}): "
            f"{_short(python)}."
        ) from None
    if rng["numpy"] is not None:
        try:
            import numpy as np

            np.random.RandomState().set_state(numpy_random_state(rng["numpy"]))
        except ImportError:
            pass  # checked where the workers run, which have numpy if they need it
        except (TypeError, ValueError, IndexError) as exc:
            raise ValueError(
                f"`{where}['numpy']` is not a state of numpy's global generator ({exc}): "
                f"{_short(rng['numpy'])}."
            ) from None


def plain_python_state(state: tuple[Any, ...]) -> list[Any]:
    """``random.getstate()`` as plain data."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def python_random_state(value: object) -> tuple[Any, ...]:
    """The ``random.setstate()`` argument that `plain_python_state` gave as a list."""
    if not isinstance(value, list) or len(value) != 3 or not isinstance(value[1], list):
        raise ValueError("not a [version, [ints], gauss_next] list")
    return (value[0], tuple(value[1]), value[2])


def plain_numpy_state(state: tuple[Any, ...]) -> list[Any]:
    """``numpy.random.get_state()`` as plain data."""
    name, keys, pos, has_gauss, cached = state
    return [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def numpy_random_state(value: object) -> tuple[Any, ...]:
    """The ``numpy.random.set_state()`` argument that `plain_numpy_state` gave as a list."""
    import numpy as np

    if not isinstance(value, list) or len(value) != 5 or not isinstance(value[1], list):
        raise ValueError("not a [name, [ints], pos, has_gauss, cached_gaussian] list")
    name, keys, pos, has_gauss, cached = value
    return (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)


def _check_together(saved: Saved, loader: dict[str, Any]) -> None:
    """Refuse field combinations that no real state holds: resuming from one would yield
    batches that no run of the loader yields (#63: a mid-epoch state whose
    ``epoch_in_progress`` was flipped replayed the received batches)."""
    iterable = loader.get("iterable", False)

    def refuse(why: str) -> None:
        raise ValueError(f"`state` cannot come from a real loader: {why}.")

    if not saved.in_epoch:
        for name, value, empty in (
            ("consumed", saved.consumed, 0),
            ("digest", saved.digest, None),
            ("iterator_state", saved.iterator_state, None),
            ("ended", saved.ended, False),
            ("next_worker", saved.next_worker, 0),
            ("fast_forward", saved.fast_forward, False),
        ):
            if value != empty:
                refuse(f"epoch_in_progress=False (between epochs) with {name}={value!r}")
        if _differ(saved.at_iter, saved.at_draw):
            refuse(
                "epoch_in_progress=False (between epochs) with rng_states_at_iter other than "
                "rng_states"
            )
        if saved.workers is not None and saved.base_seed_next:
            refuse(
                "epoch_in_progress=False with base_seed_next=True (new workers next epoch) "
                "and the states of workers that the next epoch would not have"
            )
    elif saved.base_seed_next:
        refuse(
            "epoch_in_progress=True with base_seed_next=True: only a state between epochs "
            "says whether the next epoch draws a base seed"
        )
    if saved.seed_at is not None and saved.num_workers == 0:
        refuse("rng_seed (the state persistent workers drew their seed from) with num_workers=0")
    if saved.next_worker and saved.next_worker >= max(saved.num_workers, 1):
        refuse(f"next_worker={saved.next_worker} with num_workers={saved.num_workers}")
    if not iterable:
        for name, value, empty in (
            ("iterator_state", saved.iterator_state, None),
            ("ended", saved.ended, False),
            ("next_worker", saved.next_worker, 0),
            ("fast_forward", saved.fast_forward, False),
        ):
            if value != empty:
                refuse(f"{name}={value!r} for a map-style dataset (only an IterableDataset has it)")
    if saved.num_workers and (saved.iterator_state is not None or saved.ended):
        refuse(
            "this process's iterator_state or ended with num_workers > 0 (each worker has its own)"
        )
    if saved.fast_forward and (
        saved.dataset_state is not None
        or saved.iterator_state is not None
        or any(
            w is not None and (w.dataset_state is not None or w.iterator_state is not None)
            for w in saved.workers or ()
        )
    ):
        refuse("fast_forward=True with a dataset or iterator state to resume from instead")
    if saved.workers is not None:
        for i, worker in enumerate(saved.workers):
            if worker is not None and worker.drain and worker.ended:
                refuse(f"workers[{i}] both ended (its iteration is over) and to be drained")


def _differ(a: States, b: States) -> bool:
    return any(
        (x is None) != (y is None) or (x is not None and y is not None and not torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _ints(value: object, low: int, high: int) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int and low <= v <= high for v in value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
