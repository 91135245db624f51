"""timm's own prefetching loader against DataLoaderX: the migration guide's claims, checked
against the real timm.

They need timm, which needs torchvision, and no torchvision build imports beside CI's CPU
build of torch 2.13.0, so CI skips them; they run wherever timm is installed (the run on
record: ``benchmarks/results/timm-cpu-2core.txt``). timm's ``PrefetchLoader`` on the CPU is
its loop without streams: the same batches, normalized the same way, in the caller's thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from prefetchx import DataLoaderX, fast_collate

try:
    from PIL import Image
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from timm.data.loader import PrefetchLoader
    from timm.data.loader import fast_collate as timm_collate
    from timm.data.mixup import FastCollateMixup
    from timm.data.transforms import MaybePILToTensor, ToNumpy
except ImportError:
    PrefetchLoader = None

pytestmark = pytest.mark.skipif(PrefetchLoader is None, reason="needs the `timm` package")

N = 16


class _Pictures(Dataset[tuple[Any, int]]):
    """``C, H, W`` uint8 images, as timm's prefetcher transforms end them, or PIL images."""

    def __init__(self, n: int = N, pil: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 3, 6, 8), dtype=torch.uint8, generator=g)
        self.pil = pil

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image = self.x[i]
        if self.pil:
            return Image.fromarray(image.permute(1, 2, 0).numpy()), i % 5
        return image, i % 5


def _timms(loader: DataLoader[Any], **kwargs: Any) -> Any:
    return PrefetchLoader(loader, device=torch.device("cpu"), **kwargs)


def _ours(dataset: Any, **kwargs: Any) -> DataLoaderX[Any]:
    # The migration guide's translation: timm's 0-1 mean/std times 255.
    return DataLoaderX(
        dataset,
        device="cpu",
        mean=[255 * m for m in IMAGENET_DEFAULT_MEAN],
        std=[255 * s for s in IMAGENET_DEFAULT_STD],
        **kwargs,
    )


def _epoch(loader: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.mark.parametrize("collate", ["timm", "prefetchx"])
def test_batches_are_timms_normalized_the_same_way(collate: str) -> None:
    dataset = _Pictures()
    torch.manual_seed(0)
    expected = _epoch(
        _timms(DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=timm_collate))
    )
    torch.manual_seed(0)
    ours = _ours(
        dataset,
        batch_size=4,
        shuffle=True,
        collate_fn=timm_collate if collate == "timm" else fast_collate,
    )
    got = _epoch(ours)
    assert len(got) == len(expected) == len(ours) == 4
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(y, ey)
        assert x.dtype == ex.dtype == torch.float32
        torch.testing.assert_close(x, ex, rtol=1e-6, atol=1e-6)


def test_bfloat16_is_computed_in_float32_and_cast_where_timm_computes_in_bfloat16() -> None:
    dataset = _Pictures()

    def plain_loader() -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=4, collate_fn=timm_collate)

    in_float32 = _epoch(_timms(plain_loader()))
    in_bfloat16 = _epoch(_timms(plain_loader(), img_dtype=torch.bfloat16))
    got = _epoch(_ours(dataset, batch_size=4, collate_fn=timm_collate, dtype=torch.bfloat16))
    for (x, _), (x32, _), (x16, _) in zip(got, in_float32, in_bfloat16, strict=True):
        assert x.dtype == x16.dtype == torch.bfloat16
        assert torch.equal(x, x32.to(torch.bfloat16))  # one rounding, at the end
        exact = x32.double()
        ours_error = (x.double() - exact).abs().max()
        timms_error = (x16.double() - exact).abs().max()
        assert ours_error <= timms_error
        assert timms_error > 0  # timm's differs: a guide that called them equal would be wrong


def test_mixup_draws_and_the_switch_are_timms() -> None:
    # timm's train.py turns mixup off through the prefetching loader once epoch >= mixup_off_epoch;
    # the mixing draws come from numpy's global generator, in whichever thread collates.
    dataset = _Pictures()
    epochs: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
    for name in ("timm", "prefetchx"):
        mixup = FastCollateMixup(
            mixup_alpha=1.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=5
        )
        loader: Any
        if name == "timm":
            loader = _timms(DataLoader(dataset, batch_size=4, collate_fn=mixup))
        else:
            loader = _ours(dataset, batch_size=4, collate_fn=mixup)
        np.random.seed(0)
        runs = [_epoch(loader)]
        assert loader.mixup_enabled is True
        loader.mixup_enabled = False
        assert mixup.mixup_enabled is False
        runs.append(_epoch(loader))
        epochs[name] = runs
    for ours, timms in zip(epochs["prefetchx"], epochs["timm"], strict=True):
        for (x, y), (ex, ey) in zip(ours, timms, strict=True):
            torch.testing.assert_close(y, ey, rtol=0, atol=0)
            torch.testing.assert_close(x, ex, rtol=1e-6, atol=1e-6)
    first, second = epochs["prefetchx"]
    assert any(y.max() < 1 for _, y in first)  # mixed targets: smoothed, split between classes
    assert all(y.max() == 1 for _, y in second)  # mixup off: one-hot


def test_timms_transforms_end_as_our_collate_reads_them_except_to_numpy() -> None:
    dataset = _Pictures(pil=True)
    samples = [dataset[i] for i in range(4)]
    tensors = [(MaybePILToTensor()(image), target) for image, target in samples]
    ours, targets = fast_collate(tensors)
    theirs, their_targets = timm_collate(tensors)
    assert torch.equal(ours, theirs)
    assert torch.equal(targets, their_targets)
    assert torch.equal(fast_collate(samples)[0], theirs)  # PIL images, read H, W, C
    arrays = [(ToNumpy()(image), target) for image, target in samples]
    assert arrays[0][0].shape == (3, 6, 8)  # C, H, W: the other layout for a numpy array
    with pytest.raises(ValueError, match=r"torch\.from_numpy"):
        fast_collate(arrays)
    assert torch.equal(timm_collate(arrays)[0], theirs)  # timm's own collate takes them


def test_an_empty_loader_yields_nothing_in_both() -> None:
    empty = _Pictures(0)
    assert list(_timms(DataLoader(empty, batch_size=4, collate_fn=timm_collate))) == []
    assert list(_ours(empty, batch_size=4, collate_fn=timm_collate)) == []


def test_what_timms_train_script_reads_from_its_loader() -> None:
    dataset = _Pictures()
    plain_loader = DataLoader(dataset, batch_size=4, collate_fn=timm_collate)
    theirs, ours = _timms(plain_loader), _ours(dataset, batch_size=4, collate_fn=timm_collate)
    assert len(ours) == len(theirs) == 4
    assert ours.dataset is theirs.dataset is dataset
    assert type(ours.sampler) is type(theirs.sampler)
    assert type(ours.batch_sampler) is type(theirs.batch_sampler)
    assert ours.mixup_enabled is theirs.mixup_enabled is False
