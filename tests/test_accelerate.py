"""prefetchx.accelerate and the Hugging Face Trainer, against accelerate's own loader.

Every test runs the same loop over accelerate's own prepared loader and over the prefetching
one, in the same test, and compares what the loop saw batch by batch: the batches, accelerate's
``sync_gradients``, ``end_of_dataloader`` and ``remainder``, optimizer steps, evaluation counts
and losses. Each skips cleanly where accelerate (or transformers) is not installed.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from prefetchx import DataLoaderX, Prefetcher

accelerate = pytest.importorskip("accelerate")

from accelerate.data_loader import (  # noqa: E402
    DataLoaderDispatcher,
    DataLoaderShard,
    prepare_data_loader,
)
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin  # noqa: E402

import prefetchx.accelerate as pxa  # noqa: E402  # imports accelerate

N = 38  # 10 batches of 4, the last of 2: accelerate's remainder is 2
MEAN = STD = (127.5, 127.5, 127.5)
STAGES = {"mean": MEAN, "std": STD, "max_prefetch": 3}


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps its state in process-wide singletons: each test starts afresh."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _images(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randint(0, 256, (n, 3, 2, 2), dtype=torch.uint8, generator=g), torch.arange(n)
    )


def _normalized(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and bool(x.min() >= -1) and bool(x.max() <= 1)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("prefetchx-")}


def _accelerator(**kwargs: Any) -> Any:
    return accelerate.Accelerator(cpu=True, **kwargs)


# --- accelerator.prepare(DataLoaderX) ------------------------------------------------------------


def test_accelerator_prepare_warns_at_once_with_the_fix() -> None:
    accelerator = _accelerator()
    with pytest.warns(UserWarning, match=r"prefetchx\.accelerate\.prepare\(accelerator") as seen:
        accelerator.prepare(DataLoaderX(_images(), batch_size=4, mean=MEAN, std=STD))
    assert [Path(w.filename).name for w in seen] == [Path(__file__).name]  # the caller's line


def test_prepare_is_accelerates_loader_with_a_dataloaderx_inside() -> None:
    accelerator = _accelerator()
    model = torch.nn.Linear(12, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    given = DataLoaderX(_images(), batch_size=4, shuffle=True, channels_last=True, **STAGES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, optimizer, loader = pxa.prepare(accelerator, model, optimizer, given)
        assert accelerator.prepare(loader) is loader  # prepared already, not rebuilt
    assert type(loader) is DataLoaderShard
    assert loader in accelerator._dataloaders
    inside = loader.base_dataloader
    assert type(inside) is DataLoaderX
    assert (inside.mean, inside.max_prefetch, inside.channels_last) == (MEAN, 3, True)
    assert inside.batch_sampler.sampler is given.sampler  # the same objects: shuffles, epochs
    x, _ = next(iter(loader))
    assert _normalized(x)
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer)


def test_add_stages_takes_only_accelerates_loaders_and_once() -> None:
    prepared = _accelerator().prepare(DataLoader(_images(), batch_size=4))
    assert pxa.add_stages(prepared, **STAGES) is prepared
    inside = prepared.base_dataloader
    assert pxa.add_stages(prepared, max_prefetch=1) is prepared
    assert prepared.base_dataloader is inside  # has them already
    with pytest.raises(TypeError, match="expected a loader accelerate prepared"):
        pxa.add_stages(DataLoader(_images(), batch_size=4))


# --- training and evaluation loops, batch by batch -----------------------------------------------


def _prepared(path: str, accelerator: Any, **loader_args: Any) -> Any:
    """The loader a path gives the loop: accelerate's own, or one of the prefetching ones."""
    if path == "accelerate":
        return accelerator.prepare(DataLoader(_images(), **loader_args))
    if path == "prepare":
        return pxa.prepare(accelerator, DataLoaderX(_images(), **loader_args, **STAGES))
    plain = accelerator.prepare(DataLoader(_images(), **loader_args))
    if path == "add_stages":
        return pxa.add_stages(plain, **STAGES)
    assert path == "Prefetcher"
    return Prefetcher(plain, **STAGES)


def _train(path: str, step_s: float, sampler: str) -> list[tuple[Any, ...]]:
    """Two epochs with gradient accumulation over 4 batches, accelerate's default plugin
    (``sync_with_dataloader=True``); per batch: what the loop saw and what accelerate said.

    ``sampler``: shuffled by a ``RandomSampler``, or by accelerate's ``SeedableRandomSampler``,
    whose shuffle follows the epoch: set by the loop, or counted by accelerate's loader.
    """
    seedable = sampler != "RandomSampler"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = _accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable, data_seed=7),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = _prepared(path, accelerator, batch_size=4, shuffle=True)
    steps = 0
    record = []
    threads: set[str] = set()
    for epoch in range(2):
        if sampler == "Seedable+set_epoch":
            loader.set_epoch(epoch)
        for x, y in loader:
            state = accelerator.gradient_state
            with accelerator.accumulate(model):
                inputs = x.float() if path == "accelerate" else x
                accelerator.backward(model(inputs.flatten(1)).pow(2).mean())
                optimizer.step()  # skipped by accelerate unless it syncs
                steps += accelerator.sync_gradients
                optimizer.zero_grad()
            said = (accelerator.sync_gradients, state.end_of_dataloader, state.remainder)
            record.append((epoch, y.tolist(), *said, steps))
            if path != "accelerate":
                assert _normalized(x)
                threads |= _threads()
            time.sleep(step_s)
    assert not accelerator.gradient_state.in_dataloader
    assert threads == (set() if path == "accelerate" else {"prefetchx-thread"})
    return record


@pytest.mark.parametrize("path", ["prepare", "add_stages", "Prefetcher"])
@pytest.mark.parametrize("step_s", [0.0, 0.003], ids=["short-steps", "long-steps"])
@pytest.mark.parametrize("sampler", ["RandomSampler", "Seedable", "Seedable+set_epoch"])
def test_gradient_accumulation_over_epochs_as_with_accelerates_loader(
    path: str, step_s: float, sampler: str
) -> None:
    expected = _train("accelerate", 0.0, sampler)
    got = _train(path, step_s, sampler)
    assert got == expected
    assert expected[-1][-1] == 6  # 3 optimizer steps an epoch: after 4, 8 and 10 batches
    epochs = [[y for epoch, y, *_ in expected if epoch == e] for e in (0, 1)]
    assert epochs[0] != epochs[1]  # each epoch its own shuffle
    assert [r[3:5] for r in expected[8:10]] == [(False, 2), (True, 2)]


@pytest.mark.parametrize("path", ["prepare", "add_stages", "Prefetcher"])
def test_evaluation_sees_every_sample_and_the_end_where_accelerate_does(path: str) -> None:
    def evaluate(path: str) -> list[tuple[Any, ...]]:
        accelerator = _accelerator()
        loader = _prepared(path, accelerator, batch_size=4)
        seen = []
        for x, y in loader:
            gathered = accelerator.gather_for_metrics(y)
            state = accelerator.gradient_state
            seen.append((gathered.tolist(), state.end_of_dataloader, state.remainder, x.sum()))
        return seen

    expected = evaluate("accelerate")
    got = evaluate(path)
    assert [r[:3] for r in got] == [r[:3] for r in expected]
    assert sum(len(r[0]) for r in got) == N
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    for (x, _), (_, _, _, total) in zip(DataLoader(_images(), batch_size=4), got, strict=True):
        torch.testing.assert_close(total, ((x.float() - mean) / mean).sum())


@pytest.mark.parametrize("options", [{}, {"split_batches": True}, {"even_batches": False}], ids=str)
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_gets_accelerates_shard(options: dict[str, Any], rank: int) -> None:
    def shard(stages: bool) -> tuple[int, list[list[int]]]:
        plain = DataLoader(
            TensorDataset(torch.arange(22)),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
        )
        loader = prepare_data_loader(plain, num_processes=2, process_index=rank, **options)
        if stages:
            loader = pxa.add_stages(loader, max_prefetch=2)
        return len(loader), [x.tolist() for epoch in range(2) for (x,) in loader]

    assert shard(stages=True) == shard(stages=False)


class _Count(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(22))


def test_dispatched_batches_as_with_accelerates_loader() -> None:
    def run(path: str) -> list[tuple[Any, ...]]:
        accelerator = _accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
        if path == "accelerate":
            loader = accelerator.prepare(DataLoader(_Count(), batch_size=4))
        else:
            loader = pxa.prepare(accelerator, DataLoaderX(_Count(), batch_size=4, max_prefetch=2))
            assert type(loader) is DataLoaderDispatcher
        state = accelerator.gradient_state
        return [(x.tolist(), state.end_of_dataloader, state.remainder) for x in loader]

    assert run("prefetchx") == run("accelerate")


def test_save_state_and_load_state_as_with_accelerates_loader(tmp_path: Path) -> None:
    def run(path: str) -> list[list[int]]:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)
        accelerator = _accelerator(dataloader_config=config)
        loader = _prepared(path, accelerator, batch_size=4, shuffle=True)
        epochs = [[y.tolist() for _, y in loader]]
        accelerator.save_state(str(tmp_path / path))
        epochs.append([y.tolist() for _, y in loader])
        accelerator.load_state(str(tmp_path / path))
        epochs.append([y.tolist() for _, y in loader])
        return epochs

    assert run("prepare") == run("accelerate")


# --- skip_first_batches --------------------------------------------------------------------------


def _to_skip(path: str, accelerator: Any) -> tuple[Any, Any]:
    """accelerate's own loader, and a path's prefetching one, each shuffled from seed 0."""
    torch.manual_seed(0)
    if path in ("unprepared", "Prefetcher-unprepared"):
        own: Any = DataLoader(_images(), batch_size=4, shuffle=True)
        torch.manual_seed(0)
        if path == "unprepared":
            return own, DataLoaderX(_images(), batch_size=4, shuffle=True, **STAGES)
        return own, Prefetcher(DataLoader(_images(), batch_size=4, shuffle=True), **STAGES)
    own = accelerator.prepare(DataLoader(_images(), batch_size=4, shuffle=True))
    torch.manual_seed(0)
    return own, _prepared(path, accelerator, batch_size=4, shuffle=True)


@pytest.mark.parametrize(
    "path", ["prepare", "add_stages", "Prefetcher", "unprepared", "Prefetcher-unprepared"]
)
def test_skip_first_batches_keeps_the_stages(path: str) -> None:
    accelerator = _accelerator()
    expected_loader, loader = _to_skip(path, accelerator)

    def run(skipped: Any) -> list[tuple[Any, ...]]:
        state = accelerator.gradient_state
        return [(y.tolist(), state.end_of_dataloader, _normalized(x)) for x, y in skipped]

    torch.manual_seed(1)
    expected = run(accelerate.skip_first_batches(expected_loader, 3))
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # prefetchx's own call to accelerate's does not warn
        skipped = pxa.skip_first_batches(loader, 3)
    assert len(skipped) == len(expected) == 7
    got = run(skipped)
    assert [r[:2] for r in got] == [r[:2] for r in expected]
    assert all(normalized for *_, normalized in got)


@pytest.mark.parametrize(
    "path", ["prepare", "add_stages", "Prefetcher", "unprepared", "Prefetcher-unprepared"]
)
def test_accelerators_skip_first_batches_warns_at_once_with_the_fix(path: str) -> None:
    # accelerate's skip_first_batches rebuilds the loader as its own class over a new plain
    # DataLoader; nothing on the loader can carry the stages across, so it must say so at once.
    accelerator = _accelerator()
    own, loader = _to_skip(path, accelerator)
    torch.manual_seed(1)
    expected = [y.tolist() for _, y in accelerator.skip_first_batches(own, 3)]
    torch.manual_seed(1)
    fix = r"prefetchx\.accelerate\.skip_first_batches\(loader, num_batches\)"
    with pytest.warns(UserWarning, match=fix) as seen:
        skipped = accelerator.skip_first_batches(loader, 3)
    assert [Path(w.filename).name for w in seen] == [Path(__file__).name]  # the caller's line
    got = [(y.tolist(), _normalized(x)) for x, y in skipped]
    assert [y for y, _ in got] == expected  # accelerate's batches, as with its own loader
    assert not any(normalized for _, normalized in got)  # without the stages, as it warned


def test_the_skip_warning_survives_a_rename_inside_accelerate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The function accelerate exports is recognized as itself, not by its name or its module:
    # here it is the same code, renamed, as a refactor inside accelerate would leave it.
    exported = accelerate.skip_first_batches
    code = exported.__code__.replace(co_name="_skip_first_batches_v2")
    renamed = type(exported)(code, exported.__globals__, "_skip_first_batches_v2")
    monkeypatch.setattr(accelerate, "skip_first_batches", renamed)
    loader = DataLoaderX(_images(), batch_size=4, **STAGES)
    fix = r"prefetchx\.accelerate\.skip_first_batches\(loader, num_batches\)"
    with pytest.warns(UserWarning, match=fix) as seen:
        skipped = accelerate.skip_first_batches(loader, 3)
    assert [Path(w.filename).name for w in seen] == [Path(__file__).name]
    assert len(skipped) == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.multiprocessing_context is None  # read outside accelerate: no warning


# --- the Hugging Face Trainer --------------------------------------------------------------------

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is built here
try:
    import transformers
except ImportError:
    transformers = None
if transformers is not None and not transformers.utils.is_torch_available():
    transformers = None  # installed, but for a newer torch: its Trainer does not import
if transformers is not None:
    import transformers.trainer

needs_transformers = pytest.mark.skipif(
    transformers is None, reason="transformers with PyTorch support not installed"
)
SAMPLES = 60  # 8 batches of 8 an epoch, the last of 4
STAGE_KEY = {"mean": MEAN, "std": STD, "input_key": "pixel_values"}


class _Pictures(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (SAMPLES, 3, 4, 4), dtype=torch.uint8, generator=g)
        self.y = torch.arange(SAMPLES) % 3

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in ("pixel_values", "labels")}


def _collate_normalized(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What the stages make of a batch, made in the collate function instead."""
    batch = _collate(items)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    batch["pixel_values"] = (batch["pixel_values"] - mean) / mean
    return batch


def _trainers() -> dict[str, type]:
    """The plain Trainer, and the two documented overrides."""

    class AddStages(transformers.Trainer):  # type: ignore[misc,name-defined]
        def get_train_dataloader(self) -> Any:
            return pxa.add_stages(super().get_train_dataloader(), **STAGE_KEY)

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            return pxa.add_stages(super().get_eval_dataloader(eval_dataset), **STAGE_KEY)

    class WithPrefetcher(transformers.Trainer):  # type: ignore[misc,name-defined]
        def get_train_dataloader(self) -> Any:
            return Prefetcher(super().get_train_dataloader(), **STAGE_KEY)

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            return Prefetcher(super().get_eval_dataloader(eval_dataset), **STAGE_KEY)

    return {"Trainer": transformers.Trainer, "add_stages": AddStages, "Prefetcher": WithPrefetcher}


class _Run:
    """One Trainer with a tiny ViT built from its config; records what every step received."""

    def __init__(self, kind: str, out: Path) -> None:
        torch.manual_seed(0)
        config = transformers.ViTConfig(
            image_size=4,
            patch_size=2,
            num_channels=3,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            intermediate_size=8,
            num_labels=3,
        )
        self.model = transformers.ViTForImageClassification(config)
        self.model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self.seen: list[tuple[float, list[int]]] = []
        self.threads: set[str] = set()
        self.predictions: list[int] = []
        args = transformers.TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=8,
            per_device_eval_batch_size=8,
            gradient_accumulation_steps=3,
            num_train_epochs=2,
            eval_strategy="epoch",
            save_strategy="steps",
            save_steps=2,
            report_to=[],
            use_cpu=True,
            logging_strategy="no",
            seed=0,
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        self.trainer = _trainers()[kind](
            model=self.model,
            args=args,
            train_dataset=_Pictures(),
            eval_dataset=_Pictures(),
            data_collator=_collate_normalized if kind == "Trainer" else _collate,
            compute_metrics=self._metrics,
        )

    def _forward(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        x = kwargs["pixel_values"]
        assert x.dtype == torch.float32  # normalized, by the stages or the collate function
        if module.training:
            self.seen.append((round(x.sum().item(), 3), kwargs["labels"].tolist()))
            self.threads |= _threads()

    def _metrics(self, prediction: Any) -> dict[str, float]:
        self.predictions.append(len(prediction.predictions))
        return {}

    def outcome(self) -> dict[str, Any]:
        trainer = self.trainer
        return {
            "steps": trainer.state.global_step,
            "seen": self.seen,
            "predictions": self.predictions,
            "eval_loss": [
                log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log
            ],
            "num_examples": trainer.num_examples(trainer.get_train_dataloader()),
        }


@needs_transformers
@pytest.mark.parametrize("kind", ["add_stages", "Prefetcher"])
def test_trainer_trains_evaluates_and_resumes_as_the_plain_trainer(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The documented line that keeps the stages in the epoch a mid-epoch resume skips into.
    monkeypatch.setattr(transformers.trainer, "skip_first_batches", pxa.skip_first_batches)
    outcomes = {}
    for name in ("Trainer", kind):
        run = _Run(name, tmp_path / name)
        run.trainer.train()
        outcomes[name] = run.outcome()
        if name == kind:
            assert run.threads == {"prefetchx-thread"}
    expected = outcomes["Trainer"]
    assert outcomes[kind] == expected
    assert expected["steps"] == 6  # 3 optimizer steps an epoch: after 3, 6 and 8 batches
    assert expected["predictions"] == [SAMPLES, SAMPLES]
    assert expected["num_examples"] == SAMPLES
    first, second = expected["seen"][:8], expected["seen"][8:]
    assert sorted(y for _, ys in first for y in ys) == sorted(y for _, ys in second for y in ys)
    assert first != second  # each epoch its own shuffle

    resumed = {}
    for name in ("Trainer", kind):
        run = _Run(name, tmp_path / name)
        run.trainer.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        resumed[name] = run.outcome()
        if name == kind:
            assert run.threads == {"prefetchx-thread"}
    assert resumed[kind] == resumed["Trainer"]
    assert len(resumed["Trainer"]["seen"]) == 16 - 6  # checkpoint-2 is 6 batches in


@needs_transformers
def test_trainer_resume_without_the_line_warns_at_once_with_the_fix(tmp_path: Path) -> None:
    # The Trainer skips into the resumed epoch with accelerate's skip_first_batches, from its
    # private _run_epoch, on the loader get_train_dataloader returned: without the documented
    # line, the epoch would run on accelerate's plain loader, unnormalized.
    _Run("add_stages", tmp_path).trainer.train()
    run = _Run("add_stages", tmp_path)
    fix = r"prefetchx\.accelerate\.skip_first_batches\(loader, num_batches\)"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="prefetchx: accelerate's skip_first_batches")
        with pytest.raises(UserWarning, match=fix):
            run.trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert run.seen == []  # before the first step
