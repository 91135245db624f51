"""DataLoaderX's device-stage arguments on a machine without an accelerator (the CPU path)."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from prefetchx import DataLoaderX, Prefetcher, _producer
from prefetchx._loader import _refuses_pinning
from prefetchx._normalize import Normalize
from prefetchx._pipeline import Pipeline
from tests.fakecuda import FakeCuda
from tests.helpers import AlwaysAlone, ThreadGate, wait_until

MEAN, STD = (10.0, 20.0, 30.0), (2.0, 4.0, 8.0)


class Images(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "image": torch.full((3, 2, 2), 10 * i, dtype=torch.uint8),
            "label": i,
            "name": f"img{i}",
        }


def _expected(images: torch.Tensor) -> torch.Tensor:
    return (images.float() - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1
    )


@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_normalizes_the_input_on_the_cpu(max_prefetch: int) -> None:
    plain = list(DataLoader(Images(), batch_size=3))
    ours = list(
        DataLoaderX(
            Images(),
            batch_size=3,
            mean=MEAN,
            std=STD,
            dtype=torch.bfloat16,
            channels_last=True,
            input_key="image",
            max_prefetch=max_prefetch,
        )
    )
    assert len(ours) == 2
    for got, want in zip(ours, plain, strict=True):
        assert got["image"].dtype == torch.bfloat16
        assert got["image"].is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(
            got["image"], _expected(want["image"]).bfloat16(), rtol=0, atol=0
        )
        assert torch.equal(got["label"], want["label"])  # other leaves keep their dtype
        assert got["name"] == want["name"]


def test_cpu_normalization_runs_in_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    original = Normalize.__call__

    def spy(self: Normalize, x: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return original(self, x)

    monkeypatch.setattr(Normalize, "__call__", spy)
    loader = DataLoaderX(
        Images(), batch_size=2, mean=MEAN, std=STD, input_key="image", device="cpu", max_prefetch=4
    )
    it = iter(loader)
    next(it)
    # A step long enough for the thread to make the rest (a batch the thread has not started
    # when the loop asks is made, and normalized, in the loop's thread).
    assert wait_until(lambda: len(threads) == 3)
    assert len(list(it)) == 2
    # The first batch of an epoch is made in the caller's thread, the later ones in the thread.
    assert threads == [threading.current_thread().name] + ["prefetchx-thread"] * 2


def test_without_normalization_batches_equal_dataloader() -> None:
    plain = list(DataLoader(Images(), batch_size=4))
    ours = list(DataLoaderX(Images(), batch_size=4, device="cpu"))
    for got, want in zip(ours, plain, strict=True):
        assert torch.equal(got["image"], want["image"])
        assert got["image"].dtype == torch.uint8


def test_channel_mismatch_raises_at_the_first_batch() -> None:
    loader = DataLoaderX(
        Images(), batch_size=3, mean=(1.0,), std=(1.0,), input_key="image", device="cpu"
    )
    with pytest.raises(ValueError, match=r"1 channels but the input has 3"):
        next(iter(loader))


def test_every_argument_is_a_same_named_attribute_and_in_the_signature() -> None:
    kwargs: dict[str, Any] = {
        "max_prefetch": 3,
        "device": "cpu",
        "mean": MEAN,
        "std": STD,
        "dtype": torch.float16,
        "channels_last": True,
        "input_key": "image",
        "device_prefetch": 2,
        "non_blocking": False,
    }
    loader = DataLoaderX(Images(), batch_size=3, **kwargs)
    params = inspect.signature(DataLoaderX).parameters
    for name, value in kwargs.items():
        assert getattr(loader, name) == value
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    # A framework can rebuild the loader from the attributes.
    rebuilt = DataLoaderX(
        loader.dataset, batch_size=3, **{name: getattr(loader, name) for name in kwargs}
    )
    assert rebuilt.mean == MEAN


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"device": "cuda:7"}, ValueError, r"`device` 'cuda:7'"),
        ({"device": "tpu"}, ValueError, r"`device` 'tpu'"),
        ({"mean": MEAN}, ValueError, r"`mean` was given without `std`"),
        ({"dtype": torch.int64}, ValueError, r"`dtype` must be a floating dtype"),
        ({"device_prefetch": -1}, ValueError, r"`device_prefetch` must be >= 0, got -1"),
        ({"device_prefetch": 1.0}, TypeError, r"`device_prefetch` must be an int"),
        ({"non_blocking": "yes"}, TypeError, r"`non_blocking` must be a bool, got 'yes'"),
        ({"input_key": 1.5}, TypeError, r"`input_key` must be an int index or a str key, got 1\.5"),
        ({"channels_last": "no"}, TypeError, r"`channels_last` must be a bool"),
    ],
)
def test_bad_arguments_raise_at_construction(
    kwargs: dict[str, Any], exc: type[Exception], pattern: str
) -> None:
    with pytest.raises(exc, match=pattern):
        DataLoaderX(Images(), **kwargs)


def test_pin_memory_keeps_dataloaders_default_and_an_explicit_false_warns_once() -> None:
    # The thread stage pins for a CUDA target; DataLoader's pinning would fail on a dataset that
    # returns CUDA tensors, which DataLoader itself accepts.
    dataset = Images()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _refuses_pinning(dataset, (), {})
        assert not _refuses_pinning(dataset, (), {"pin_memory": True})
    with pytest.warns(UserWarning, match=r"pin_memory=False.*synchronous.*Leave pin_memory unset"):
        assert _refuses_pinning(dataset, (1, False, None, None, 0, None, False), {})


# --- A CUDA target, with CUDA replaced by the model of tests/fakecuda.py.


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Loaders built with ``device="cpu"`` target a modelled ``cuda:0`` when they iterate."""
    fake = FakeCuda()
    fake.pinned_in: list[str] = []  # type: ignore[attr-defined]
    pin = fake.pin

    def recording_pin(tensor: torch.Tensor) -> torch.Tensor:
        fake.pinned_in.append(threading.current_thread().name)  # type: ignore[attr-defined]
        return pin(tensor)

    fake.pin = recording_pin  # type: ignore[method-assign]

    def side_streams(self: Pipeline) -> FakeCuda:
        self._streams = fake  # type: ignore[assignment]
        return fake

    monkeypatch.setattr(Pipeline, "target", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(Pipeline, "_side_streams", side_streams)
    monkeypatch.setattr(_producer, "set_thread_device", lambda device: None)
    return fake


def _on_model_device(fake: FakeCuda, normalize: Normalize) -> None:
    """The constants prepare() makes with fill kernels, as the model's device tensors."""
    assert normalize.mean is not None
    assert normalize.std is not None
    constants = (
        fake.on_device(torch.tensor(normalize.mean)),
        fake.on_device(torch.tensor(normalize.std)),
    )
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        normalize._constants[device] = constants


def test_with_a_cuda_target_the_thread_makes_every_batch_after_the_first(
    fake_gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the thread runs (conftest keeps it running), the device stage pins and copies only
    # what the thread made, on the target device: its caller waits for a thread that is late
    # (a CPU target's would make the batch itself).
    expected = list(DataLoader(Images(), batch_size=2))
    loader = DataLoaderX(Images(), batch_size=2, device="cpu", input_key="image")
    gate = ThreadGate(monkeypatch)
    with fake_gpu:
        it = iter(loader)
        got = [next(it)]  # made in the caller's thread, which starts the thread
        threading.Timer(0.5, gate.open.set).start()
        got += list(it)
        assert gate.open.is_set()  # the loop waited for the thread
        fake_gpu.complete_all()
    me = threading.current_thread().name
    pinned = fake_gpu.pinned_in  # type: ignore[attr-defined]
    assert pinned == [me] * 2 + ["prefetchx-thread"] * 2 * (len(expected) - 1)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours["label"], theirs["label"])


class Recorded(Images):
    """`Images` that records each index it is asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.asked.append(i)
        return super().__getitem__(i)


def _asked_while_held(loader: Any, dataset: Recorded) -> list[int]:
    """How many items the dataset had made each time the loop held a batch."""
    return [len(dataset.asked) for _ in loader]


def test_with_a_cuda_target_and_no_thread_no_batch_is_made_ahead(fake_gpu: FakeCuda) -> None:
    # device_prefetch copies ahead only what the thread has ready: with max_prefetch=0 each
    # batch is made when asked, as DataLoader makes it (docs/configuration.md).
    theirs = Recorded()
    expected = _asked_while_held(DataLoader(theirs, batch_size=2), theirs)
    ours = Recorded()
    loader = DataLoaderX(ours, batch_size=2, device="cpu", max_prefetch=0, device_prefetch=1)
    with fake_gpu:
        got = _asked_while_held(loader, ours)
        fake_gpu.complete_all()
    assert got == expected == [2, 4, 6]
    assert ours.asked == theirs.asked


class Failing(Images):
    """`Images` of ``n`` items whose item ``fail_at`` raises, as a bad file does; each item
    takes ``delay`` seconds."""

    def __init__(self, n: int, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.n, self.fail_at, self.delay = n, fail_at, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.delay:
            time.sleep(self.delay)
        if i == self.fail_at:
            raise ValueError(f"item {i} is bad")
        return {"image": torch.full((3, 2, 2), i, dtype=torch.uint8), "label": i}


def _outcomes(loader: Any, step: float = 0.0) -> list[Any]:
    """Each ``next()``'s batch (its labels and images), or the error it raised; ``step``
    seconds of sleep after each, as a step."""
    out: list[Any] = []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except ValueError as exc:
            out.append(str(exc))
        else:
            out.append(batch)  # read after the loop: reading is a step
        if step:
            time.sleep(step)
    return [b if isinstance(b, str) else (b["label"].tolist(), b["image"]) for b in out]


def _same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        if isinstance(theirs, str):
            assert ours == theirs
        else:
            assert ours[0] == theirs[0]
            assert torch.equal(ours[1], theirs[1])


@pytest.mark.usefixtures("both_modes")
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_with_a_cuda_target_the_outcomes_are_dataloaders_while_the_thread_comes_and_goes(
    fake_gpu: FakeCuda, depth: int
) -> None:
    # Switching, the thread parks every other batch with batches in flight on the device; the
    # device stage then copies each batch when asked, and goes on copying ahead once the thread
    # is back. Nothing is lost, reordered or raced, and an error comes in its turn.
    expected = _outcomes(DataLoader(Failing(40, fail_at=13), batch_size=2))
    loader = DataLoaderX(Failing(40, fail_at=13), batch_size=2, device="cpu", device_prefetch=depth)
    with fake_gpu:
        got = _outcomes(loader)
        fake_gpu.complete_all()
    _same(got, expected)
    assert fake_gpu.hazards == []
    assert fake_gpu.host_syncs == 0


@pytest.mark.adaptive
def test_with_a_cuda_target_and_the_thread_parked_the_loop_makes_its_batches_itself(
    fake_gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where the loop runs without the thread (a loop with no step), every batch is made and
    # pinned in the loop's thread, as DataLoader makes them, and copied ahead.
    monkeypatch.setattr("prefetchx._pipeline.Decision", AlwaysAlone)
    expected = _outcomes(DataLoader(Failing(60, fail_at=31), batch_size=2))
    loader = DataLoaderX(Failing(60, fail_at=31), batch_size=2, device="cpu")
    with fake_gpu:
        got = _outcomes(loader)
        fake_gpu.complete_all()
    _same(got, expected)
    me = threading.current_thread().name
    assert set(fake_gpu.pinned_in) == {me}  # type: ignore[attr-defined]
    assert loader.stats.inline_batches == 30
    assert fake_gpu.hazards == []


@pytest.mark.adaptive
def test_with_a_cuda_target_a_thread_that_hides_the_data_takes_over(fake_gpu: FakeCuda) -> None:
    # 2 ms of data and 2 ms of step a batch: the thread halves the loop's time, and wins.
    expected = _outcomes(DataLoader(Failing(120), batch_size=2))
    loader = DataLoaderX(Failing(120, delay=0.001), batch_size=2, device="cpu")
    with fake_gpu:
        got = _outcomes(loader, step=0.002)
        fake_gpu.complete_all()
    _same(got, expected)
    pinned = fake_gpu.pinned_in[2 * 24 :]  # type: ignore[attr-defined]  # past the first probe
    assert pinned.count("prefetchx-thread") > len(pinned) / 2, pinned
    assert fake_gpu.hazards == []


@dataclasses.dataclass
class Pair:
    image: torch.Tensor
    label: torch.Tensor


def _pairs(items: list[dict[str, Any]]) -> Pair:
    return Pair(torch.stack([d["image"] for d in items]), torch.tensor([d["label"] for d in items]))


@pytest.mark.parametrize("collate", ["default", "dataclass"])
def test_with_a_cuda_target_every_host_leaf_is_pinned_before_its_copy(
    fake_gpu: FakeCuda, collate: str
) -> None:
    # DataLoader's pin_memory returns dataclass batches unpinned; the thread pins every leaf.
    kwargs: dict[str, Any] = {"batch_size": 2}
    if collate == "dataclass":
        kwargs["collate_fn"] = _pairs
    expected = list(DataLoader(Images(), **kwargs))
    loader = DataLoaderX(Images(), device="cpu", input_key="image", **kwargs)
    with fake_gpu:
        got = list(loader)
        fake_gpu.complete_all()
    assert fake_gpu.host_syncs == 0, fake_gpu.host_sync_reasons  # every copy from pinned memory
    assert fake_gpu.hazards == []
    leaves = 2  # image and label (the names are strings)
    assert len(fake_gpu.pinned_in) == leaves * len(expected)  # type: ignore[attr-defined]
    # The first batch is made, and so pinned, in the caller's thread; the rest in the thread.
    assert set(fake_gpu.pinned_in[leaves:]) == {"prefetchx-thread"}  # type: ignore[attr-defined]
    for ours, theirs in zip(got, expected, strict=True):
        if collate == "dataclass":
            assert torch.equal(ours.image, theirs.image)
            assert torch.equal(ours.label, theirs.label)
        else:
            assert torch.equal(ours["image"], theirs["image"])
            assert ours["name"] == theirs["name"]


def test_without_pinning_every_copy_makes_the_host_wait(fake_gpu: FakeCuda) -> None:
    loader = DataLoaderX(Images(), batch_size=2, device="cpu")
    loader._pipeline.pin_host = False  # what pin_memory=False sets with a CUDA target
    with fake_gpu:
        assert len(list(loader)) == 3
        fake_gpu.complete_all()
    assert fake_gpu.host_syncs == 3 * 2  # image and label of each batch, copied from pageable
    assert fake_gpu.pinned_in == []  # type: ignore[attr-defined]


class OnDevice(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Items the caller's code made on the device (a GPU-resident dataset)."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.fake.on_device(torch.full((3, 2, 2), 10 * i, dtype=torch.uint8)), i


@pytest.mark.parametrize("wrap", ["DataLoaderX", "Prefetcher"])
def test_a_dataset_on_the_device_is_not_pinned_nor_copied_and_nothing_races(
    fake_gpu: FakeCuda, wrap: str
) -> None:
    # In the caller's thread (max_prefetch=0), where the model sees the collate's kernels.
    kwargs: dict[str, Any] = {"mean": MEAN, "std": STD, "max_prefetch": 0, "device": "cpu"}
    with fake_gpu:
        if wrap == "DataLoaderX":
            batches: Any = DataLoaderX(OnDevice(fake_gpu), batch_size=2, **kwargs)
        else:
            batches = Prefetcher(DataLoader(OnDevice(fake_gpu), batch_size=2), **kwargs)
        _on_model_device(fake_gpu, batches._pipeline.normalize)
        got = [(x * 1, y) for x, y in batches]  # a step queued on each, never run
        fake_gpu.complete_all()
    assert fake_gpu.hazards == []
    assert fake_gpu.host_syncs == 0
    # Only the labels, collated on the host, are pinned; the images were on the device.
    assert len(fake_gpu.pinned_in) == 3  # type: ignore[attr-defined]
    for i, (x, y) in enumerate(got):
        images = torch.stack(
            [torch.full((3, 2, 2), 10 * j, dtype=torch.uint8) for j in (2 * i, 2 * i + 1)]
        )
        assert torch.equal(x, _expected(images))
        assert y.tolist() == [2 * i, 2 * i + 1]
