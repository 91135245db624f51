"""Lightning, which rebuilds, checkpoints and resumes loaders (the `integrations` extra).

Each test skips cleanly when Lightning is not installed; CI installs the extra. accelerate and
the Hugging Face Trainer are tests/test_accelerate.py's.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from prefetchx import DataLoaderX
from tests.helpers import wait_until

N = 24
MEAN = STD = (127.5, 127.5, 127.5)  # uint8 0-255 to [-1, 1]


def _dataset() -> TensorDataset:
    images = torch.randint(0, 256, (N, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator())
    return TensorDataset(images, torch.arange(N))


def _loader(**kwargs: Any) -> DataLoaderX[Any]:
    return DataLoaderX(
        _dataset(), batch_size=4, shuffle=True, max_prefetch=3, mean=MEAN, std=STD, **kwargs
    )


def _came_through_the_stages(x: torch.Tensor) -> bool:
    """Normalized in the stages: float32 in [-1, 1], not the collated uint8."""
    return x.dtype == torch.float32 and bool(x.min() >= -1) and bool(x.max() <= 1)


# --- Lightning ----------------------------------------------------------------------------------

try:
    import lightning.pytorch as pl
except ImportError:  # the tests below skip; the class still needs a base
    pl = None

needs_lightning = pytest.mark.skipif(pl is None, reason="lightning is not installed")


class _Module(pl.LightningModule if pl is not None else object):  # type: ignore[misc]
    """Records what each training step received; writes it per rank when asked to."""

    def __init__(self, out_dir: str | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(48, 1)
        self.out_dir = out_dir
        self.seen: dict[int, list[list[int]]] = {}  # epoch: batches (a resumed epoch has no start)
        self.normalized: list[bool] = []
        self.loaders: list[dict[str, Any]] = []

    def train_dataloader(self) -> DataLoaderX[Any]:
        return _loader()

    def on_train_epoch_start(self) -> None:
        loader = self.trainer.train_dataloader
        self.loaders.append(
            {
                "type": type(loader).__name__,
                "max_prefetch": getattr(loader, "max_prefetch", None),
                "mean": list(getattr(loader, "mean", None) or []),
                "sampler": type(loader.sampler).__name__,
            }
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.setdefault(self.current_epoch, []).append(y.tolist())
        self.normalized.append(_came_through_the_stages(x))
        loss: torch.Tensor = self.layer(x.flatten(1)).pow(2).mean()
        return loss

    def on_train_end(self) -> None:
        if self.out_dir is not None:
            record = {"seen": self.seen, "normalized": self.normalized, "loaders": self.loaders}
            Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(**kwargs: Any) -> Any:
    options = {"max_epochs": 2, "enable_checkpointing": False, **kwargs}
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


@needs_lightning
def test_lightning_rebuilds_a_dataloaderx_with_its_arguments() -> None:
    # What Trainer does to every training loader under a distributed strategy.
    from lightning.pytorch.utilities.data import _update_dataloader

    loader = _loader(channels_last=True, dtype=torch.bfloat16)
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler)
    assert type(rebuilt) is DataLoaderX
    assert rebuilt.sampler is sampler
    names = ("max_prefetch", "mean", "std", "dtype", "channels_last", "batch_size")
    assert {n: getattr(rebuilt, n) for n in names} == {n: getattr(loader, n) for n in names}
    x, y = next(iter(rebuilt))
    assert x.dtype == torch.bfloat16
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert y.tolist() == [1, 3, 5, 7]  # rank 1 of 2, unshuffled


@needs_lightning
def test_lightning_trainer_trains_on_dataloaderx_batches() -> None:
    module = _Module()
    _trainer(devices=1).fit(module)
    assert [info["type"] for info in module.loaders] == ["DataLoaderX", "DataLoaderX"]
    assert all(module.normalized)
    assert len(module.normalized) == 2 * N // 4
    for epoch in module.seen.values():
        assert sorted(i for batch in epoch for i in batch) == list(range(N))
    assert module.seen[0] != module.seen[1]  # reshuffled
    # Lightning takes len() batches and lets go of the last epoch's iterator when it is done
    # with it; the thread stops then, within moments (CI once caught it still ending). As the
    # no_leaks fixture does after every test: a collection, and a bounded wait.
    gc.collect()
    assert wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]
    )


@needs_lightning
def test_lightning_ddp_rebuilds_dataloaderx_with_a_distributed_sampler(tmp_path: Path) -> None:
    _trainer(devices=2, strategy="ddp_spawn").fit(_Module(out_dir=str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        for info in rank["loaders"]:
            assert info == {
                "type": "DataLoaderX",
                "max_prefetch": 3,
                "mean": list(MEAN),
                "sampler": "DistributedSampler",
            }
        assert all(rank["normalized"])
    for epoch in (0, 1):
        shards = [{i for batch in rank["seen"][str(epoch)] for i in batch} for rank in ranks]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(N))


class _StopAt(pl.Callback if pl is not None else object):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


@needs_lightning
def test_lightning_resumes_mid_epoch_exactly_from_its_checkpoint(tmp_path: Path) -> None:
    # Lightning saves the state of any loader with state_dict/load_state_dict in its checkpoints
    # and loads it when it resumes; a mid-epoch resume continues with the batches not yet seen.
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    full = _Module()
    _trainer().fit(full)

    torch.manual_seed(0)
    part = _Module()
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=9, save_top_k=-1)
    _trainer(callbacks=[every, _StopAt(9)], enable_checkpointing=True).fit(part)
    (path,) = tmp_path.glob("*.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    (state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (state["format"], state["epoch_in_progress"], state["consumed"]) == (
        "prefetchx.DataLoaderX",
        True,
        3,
    )

    torch.manual_seed(123)
    resumed = _Module()
    _trainer().fit(resumed, ckpt_path=path)
    assert list(resumed.seen) == [1]
    assert part.seen[1] + resumed.seen[1] == full.seen[1]


# --- Lightning's loops, each with DataLoader and with DataLoaderX in the same test ---------------


def _labels(batch: Any) -> Any:
    """What a step received, as plain data: the labels of each loader's batch."""
    if batch is None:
        return None  # a loader CombinedLoader's max_size mode has run out of
    if isinstance(batch, dict):
        return {key: _labels(value) for key, value in batch.items()}
    if isinstance(batch, list) and batch and not isinstance(batch[0], torch.Tensor):
        return [_labels(value) for value in batch]
    return batch[-1].tolist()


def _numbers(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n))


class _Recorder(pl.LightningModule if pl is not None else object):  # type: ignore[misc]
    """Records what every step of every loop received; ``loaders`` makes them (by loop name)."""

    def __init__(self, loaders: dict[str, Any]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.loaders = loaders
        self.seen: list[Any] = []

    def _step(self, loop: str, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.seen.append((loop, self.current_epoch, dataloader_idx, batch_idx, _labels(batch)))
        # A random draw per step, as dropout would: the loaders' draws must interleave as before.
        self.seen.append(torch.rand(1).item())
        return self.layer(torch.ones(1, 1)).sum()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._step("fit", batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step("validate", batch, batch_idx, dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step("test", batch, batch_idx, dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self._step("predict", batch, batch_idx, dataloader_idx)
        return _labels(batch)

    def train_dataloader(self) -> Any:
        return self.loaders["fit"]()

    def val_dataloader(self) -> Any:
        return self.loaders.get("validate", list)()  # none: no such loop

    def test_dataloader(self) -> Any:
        return self.loaders.get("test", list)()  # none: no such loop

    def predict_dataloader(self) -> Any:
        return self.loaders.get("predict", list)()  # none: no such loop

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _both(run: Any) -> tuple[Any, Any]:
    """``run(loader_class)`` with DataLoader, then with DataLoaderX, from the same seed."""
    outcomes = []
    for cls in (DataLoader, DataLoaderX):
        torch.manual_seed(0)
        outcomes.append(run(cls))
    return outcomes[0], outcomes[1]


@needs_lightning
def test_lightning_fit_validate_test_predict_see_what_dataloader_gives() -> None:
    def run(cls: Any) -> Any:
        loaders = {
            "fit": lambda: cls(_numbers(20), batch_size=4, shuffle=True),
            "validate": lambda: cls(_numbers(10), batch_size=3, shuffle=True),
            "test": lambda: [cls(_numbers(7), batch_size=2), cls(_numbers(5), batch_size=4)],
            "predict": lambda: cls(_numbers(9), batch_size=2, shuffle=True),
        }
        module = _Recorder(loaders)
        trainer = _trainer(val_check_interval=2)
        trainer.fit(module)
        trainer.validate(module)
        trainer.test(module)
        predictions = trainer.predict(module)
        return module.seen, predictions

    expected, got = _both(run)
    assert got == expected
    predicted = [i for batch in expected[1] for i in batch]
    assert sorted(predicted) == list(range(9))  # predict: each batch once, none lost


@needs_lightning
def test_lightning_validation_over_the_training_loader_leaves_the_epoch_whole() -> None:
    def run(cls: Any) -> Any:
        loader = cls(_numbers(40), batch_size=4, shuffle=True)
        module = _Recorder({"fit": lambda: loader, "validate": lambda: loader})
        _trainer(val_check_interval=3, limit_val_batches=2).fit(module)
        return module.seen

    expected, got = _both(run)
    assert got == expected
    fit_steps = [step for step in expected if isinstance(step, tuple) and step[0] == "fit"]
    assert len(fit_steps) == 2 * 10  # every step of both epochs


@needs_lightning
@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
def test_lightning_combined_loaders_train_on_what_dataloader_gives(mode: str) -> None:
    from lightning.pytorch.utilities import CombinedLoader

    def run(cls: Any) -> Any:
        loaders = {
            "fit": lambda: CombinedLoader(
                {
                    "long": cls(_numbers(20), batch_size=4, shuffle=True),
                    "short": cls(_numbers(6), batch_size=2, shuffle=True),
                },
                mode=mode,
            ),
            "validate": lambda: CombinedLoader(
                [cls(_numbers(6), batch_size=4, shuffle=True), cls(_numbers(3), batch_size=1)],
                mode="sequential",
            ),
        }
        module = _Recorder(loaders)
        _trainer().fit(module)
        return module.seen

    expected, got = _both(run)
    assert got == expected


class _Resumable(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples in order; with ``own_state``, it saves and restores where it is."""

    def __init__(self, n: int, own_state: bool) -> None:
        self.n = n
        self.position = 0
        self.start = 0
        if own_state:
            self.state_dict = lambda: {"position": self.position}
            self.load_state_dict = lambda state: setattr(self, "start", state["position"])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self.start = self.start, 0
        self.position = start
        for i in range(start, self.n):
            self.position = i + 1
            yield torch.tensor([float(i)]), torch.tensor(i)


@needs_lightning
@pytest.mark.parametrize("own_state", [False, True], ids=["plain", "own-state"])
def test_lightning_checkpoints_an_iterable_dataset(own_state: bool, tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(cls: Any) -> Any:
        module = _Recorder({"fit": lambda: cls(_Resumable(10, own_state), batch_size=2)})
        every = ModelCheckpoint(
            dirpath=tmp_path / cls.__name__, every_n_train_steps=2, save_top_k=-1
        )
        _trainer(callbacks=[every], enable_checkpointing=True).fit(module)
        return module.seen

    expected, got = _both(run)
    assert got == expected
    checkpoints = sorted((tmp_path / "DataLoaderX").glob("*.ckpt"))
    assert len(checkpoints) == 5  # every 2 of the 2 x 5 steps
    state = torch.load(checkpoints[0], weights_only=True)["loops"]["fit_loop"]["state_dict"]
    (saved,) = state["combined_loader"]
    # Lightning looks one batch ahead in a loader without len(): 3 batches were taken.
    own = {"position": 6} if own_state else None
    assert (saved["consumed"], saved["dataset_state"]) == (3, own)


def _resume_fit(make: Any, tmp_path: Path, stop_at: int) -> tuple[list[Any], list[Any]]:
    """The fit steps of epoch 1: uninterrupted, and stopped at ``stop_at`` then resumed."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def second_epoch(module: Any) -> list[Any]:
        return [s[4] for s in module.seen if isinstance(s, tuple) and s[:2] == ("fit", 1)]

    torch.manual_seed(0)
    full = _Recorder({"fit": make})
    _trainer().fit(full)
    torch.manual_seed(0)
    part = _Recorder({"fit": make})
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=stop_at, save_top_k=-1)
    _trainer(callbacks=[every, _StopAt(stop_at)], enable_checkpointing=True).fit(part)
    (path,) = tmp_path.glob("*.ckpt")
    torch.manual_seed(123)  # the global RNG is not the saved run's
    resumed = _Recorder({"fit": make})
    _trainer().fit(resumed, ckpt_path=path)
    return second_epoch(full), second_epoch(part) + second_epoch(resumed)


class _Sized(_Resumable):
    def __len__(self) -> int:
        return self.n


class _DatasetsState(DataLoader[Any]):
    """A plain DataLoader whose state is its dataset's own: where it has got to, as any loader's
    state that counts what it has handed out (``num_workers=0``: nothing is made ahead)."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined,no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


@needs_lightning
@pytest.mark.parametrize("sized", [True, False], ids=["with-len", "without-len"])
def test_lightning_resumes_an_iterable_dataset_with_its_own_state(
    sized: bool, tmp_path: Path
) -> None:
    def run(cls: Any) -> tuple[list[Any], list[Any]]:
        def make() -> Any:
            return cls((_Sized if sized else _Resumable)(10, own_state=True), batch_size=2)

        return _resume_fit(make, tmp_path / cls.__name__, stop_at=7)  # 2 batches into epoch 1

    runs = {cls: run(cls) for cls in (DataLoader, _DatasetsState, DataLoaderX)}
    uninterrupted = runs[DataLoaderX][0]
    assert all(full == uninterrupted for full, _ in runs.values())
    resumed = {cls: then for cls, (_, then) in runs.items()}
    # DataLoader is not resumable: Lightning saves no state for it, and the resumed epoch starts
    # again at its first batch (the length Lightning counted, if any, ends it).
    again = uninterrupted[:3] if sized else uninterrupted
    assert resumed[DataLoader] == uninterrupted[:2] + again
    if sized:
        assert resumed[DataLoaderX] == resumed[_DatasetsState] == uninterrupted
    else:
        # Without len(), Lightning's loop takes each batch one step ahead, to know whether the
        # step's batch is the last, and saves the loader's state while it holds that batch: any
        # state that counts what the loader handed out counts it, so the resumed epoch goes on
        # after it (see the docs). Lightning's, not the stages': the plain loader does the same.
        assert resumed[DataLoaderX] == resumed[_DatasetsState]
        assert resumed[DataLoaderX] == uninterrupted[:2] + uninterrupted[3:]


@needs_lightning
def test_lightning_resumes_a_cycled_combined_loader_exactly(tmp_path: Path) -> None:
    # max_size_cycle restarts the short loader inside the epoch: its next shuffle draws from its
    # generator, which its state restores (the global RNG is not restored: see the FAQ).
    from lightning.pytorch.utilities import CombinedLoader

    def make() -> Any:
        long = DataLoaderX(
            _numbers(20), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        short = DataLoaderX(
            _numbers(6), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(2)
        )
        return CombinedLoader({"long": long, "short": short}, mode="max_size_cycle")

    uninterrupted, resumed = _resume_fit(make, tmp_path, stop_at=17)  # the short loader cycled
    assert resumed == uninterrupted
    assert len(uninterrupted) == 10


# --- #63 item 7: checkpoints written with DataLoaderX, as with DataLoader ------------------------


def _checkpointed_fit(cls: Any, tmp_path: Path, stop_at: int) -> Path:
    """A fit stopped at ``stop_at`` with a checkpoint there; the checkpoint's path."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = _Recorder({"fit": lambda: cls(_numbers(20), batch_size=2, shuffle=True)})
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=stop_at, save_top_k=-1)
    _trainer(callbacks=[every, _StopAt(stop_at)], enable_checkpointing=True).fit(module)
    (path,) = tmp_path.glob("*.ckpt")
    return path


@needs_lightning
def test_lightning_loop_states_compare_with_equality(tmp_path: Path) -> None:
    # #63 item 7: the loop state held the loader's generator states as tensors, so == on two
    # loop states raised "Boolean value of Tensor with more than one value is ambiguous".
    for cls in (DataLoader, DataLoaderX):
        path = _checkpointed_fit(cls, tmp_path / cls.__name__, stop_at=13)
        first, again = (torch.load(path, weights_only=True)["loops"] for _ in range(2))
        assert first == again
        assert json.loads(json.dumps(first["fit_loop"]["state_dict"])) is not None


class _BackToDataLoader(_Recorder):
    """Resumes a checkpoint written with DataLoaderX on a plain DataLoader: the documented line."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["loops"]["fit_loop"]["state_dict"].pop("combined_loader", None)


@needs_lightning
def test_lightning_resumes_a_dataloaderx_checkpoint_with_a_plain_dataloader(
    tmp_path: Path,
) -> None:
    # #63 item 7: a user who tries prefetchx and goes back could not resume their runs: "The
    # CombinedLoader has 0 stateful loaders, but found 1 states". With the one line the docs
    # give, the plain DataLoader resumes as from a checkpoint a plain DataLoader wrote.
    def resume(path: Path, module_class: type[_Recorder]) -> list[Any]:
        torch.manual_seed(123)
        module = module_class({"fit": lambda: DataLoader(_numbers(20), batch_size=2, shuffle=True)})
        _trainer().fit(module, ckpt_path=path)
        return module.seen

    plain = _checkpointed_fit(DataLoader, tmp_path / "plain", stop_at=13)
    ours = _checkpointed_fit(DataLoaderX, tmp_path / "ours", stop_at=13)
    with pytest.raises(RuntimeError, match="0 stateful loaders, but found 1 states"):
        resume(ours, _Recorder)
    assert resume(ours, _BackToDataLoader) == resume(plain, _Recorder)


class _Copies(_Recorder):
    """Copies and pickles its trainer in the middle of fit, as some callbacks and tools do."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 2:
            self.copied = [
                _outcome(lambda: copy.deepcopy(self.trainer)),
                _outcome(lambda: pickle.dumps(self.trainer)),
            ]
        return super().training_step(batch, batch_idx)


def _outcome(action: Any) -> str:
    try:
        action()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


@needs_lightning
def test_lightning_trainer_copies_and_pickles_during_fit_as_with_dataloader() -> None:
    # #63 item 7: copy.deepcopy or pickling a trainer during fit raised NotImplementedError
    # ('{} cannot be pickled', '_Chained'), where it works with DataLoader.
    def run(cls: Any) -> list[str]:
        # A partial, not a lambda: the module keeps its loader's maker, which must pickle too.
        module = _Copies({"fit": functools.partial(cls, _numbers(12), batch_size=2, shuffle=True)})
        _trainer(max_epochs=1).fit(module)
        return module.copied

    expected, got = _both(run)
    assert expected == ["ok", "ok"]
    assert got == expected
