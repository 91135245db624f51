"""Lightning, which rebuilds, checkpoints and resumes loaders (the `integrations` extra).

Each test skips cleanly when Lightning is not installed; CI installs the extra. accelerate and
the Hugging Face Trainer are tests/test_accelerate.py's.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from prefetchx import DataLoaderX

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
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetchx-")]


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
