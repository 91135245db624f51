"""A `torch.compile`d model trains on DataLoaderX batches without recompiling.

Dynamo guards a compiled graph on its inputs' dtype, shape, strides, device and autograd state;
a batch that differs in any of them compiles the model again. The backend here counts the graphs
dynamo hands it and runs them eagerly: the guards, not the code generation, are what is tested.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from prefetchx import DataLoaderX

MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
SAMPLES, BATCH_SIZE, EPOCHS = 20, 8, 3  # two full batches and a partial one of 4 per epoch


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """uint8 3x8x8 images, each made from its index, with a label."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), i % 4


class CountingBackend:
    """A `torch.compile` backend that runs graphs eagerly and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """No compiled graph or cache entry survives from one test to the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Trainer:
    """A compiled conv net with its optimizer; records every batch's layout it trains on."""

    def __init__(self, dtype: torch.dtype, channels_last: bool) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4)
        ).to(dtype)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.backend = CountingBackend()
        # fullgraph: a graph break would split the model into several graphs and blur the count.
        self.model = torch.compile(model, backend=self.backend, fullgraph=True)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.layouts: list[tuple[object, ...]] = []
        self.graphs_after_step: list[int] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.layouts.append(_layout(x))
        loss = nn.functional.cross_entropy(self.model(x).float(), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.graphs_after_step.append(self.backend.graphs)


def _layout(x: torch.Tensor) -> tuple[object, ...]:
    """Everything about a tensor that dynamo guards on and a batch could get wrong."""
    return (
        x.dtype,
        tuple(x.shape),
        x.stride(),
        x.is_contiguous(),
        x.is_contiguous(memory_format=torch.channels_last),
        x.device,
        x.requires_grad,
    )


def _loader(dtype: torch.dtype, channels_last: bool, **kwargs: Any) -> DataLoaderX[Any]:
    return DataLoaderX(
        Images(),
        batch_size=BATCH_SIZE,
        device="cpu",
        mean=MEAN,
        std=STD,
        dtype=dtype,
        channels_last=channels_last,
        **kwargs,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_full_batches_compile_once_over_epochs(dtype: torch.dtype, channels_last: bool) -> None:
    trainer = Trainer(dtype, channels_last)
    with (
        _loader(dtype, channels_last, drop_last=True) as loader,
        torch._dynamo.config.patch(error_on_recompile=True),  # a recompile fails the step
    ):
        for _ in range(EPOCHS):
            for x, y in loader:
                trainer.step(x, y)
    assert trainer.backend.graphs == 1
    assert len(trainer.layouts) == EPOCHS * (SAMPLES // BATCH_SIZE)
    assert set(trainer.layouts) == {trainer.layouts[0]}, "a batch's layout changed"
    x_dtype, shape, _, contiguous, channels_last_contiguous, device, requires_grad = (
        trainer.layouts[0]
    )
    assert (x_dtype, shape, device, requires_grad) == (
        dtype,
        (BATCH_SIZE, 3, 8, 8),
        torch.device("cpu"),
        False,
    )
    assert (contiguous, channels_last_contiguous) == (not channels_last, channels_last)


def test_batches_from_the_thread_inline_and_workers_share_one_graph() -> None:
    # The thread stage hands over batches from its thread, or from the caller's thread while
    # steps are short (the inline switch), or from worker processes: all must match one guard.
    trainer = Trainer(torch.float32, channels_last=True)
    loaders = [
        _loader(torch.float32, True, drop_last=True),
        _loader(torch.float32, True, drop_last=True, max_prefetch=0),
        _loader(torch.float32, True, drop_last=True, num_workers=2),
    ]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            for loader in loaders:
                for x, y in loader:
                    trainer.step(x, y)
    for loader in loaders:
        loader.close()
    assert trainer.backend.graphs == 1
    assert len(set(trainer.layouts)) == 1


def test_a_last_partial_batch_recompiles_once_then_never() -> None:
    # User guidance, not a defect: with drop_last=False the last batch of an epoch is smaller,
    # and dynamo compiles the model a second time when it first sees it (with the batch dim
    # dynamic from then on). Later epochs reuse both graphs. Pass drop_last=True to keep a
    # single graph, or mark the batch dim dynamic (torch._dynamo.mark_dynamic(x, 0)) up front.
    trainer = Trainer(torch.float32, channels_last=False)
    with _loader(torch.float32, False, drop_last=False) as loader:
        for _ in range(EPOCHS):
            for x, y in loader:
                trainer.step(x, y)
    assert [shape[0] for _, shape, *_ in trainer.layouts] == [8, 8, 4] * EPOCHS
    assert trainer.graphs_after_step == [1, 1, 2] + [2, 2, 2] * (EPOCHS - 1)
