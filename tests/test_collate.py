"""fast_collate: uint8 images to N, C, H, W uint8 without float work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefetchx import DataLoaderX, fast_collate


def _image(seed: int, shape: tuple[int, ...] = (4, 5, 3)) -> np.ndarray:  # type: ignore[type-arg]
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_images_with_targets() -> None:
    samples = [(_image(i), i, float(i)) for i in range(3)]
    images, targets, weights = fast_collate(samples)
    assert images.dtype == torch.uint8
    assert images.shape == (3, 3, 4, 5)
    for i in range(3):
        assert torch.equal(images[i], torch.from_numpy(_image(i)).permute(2, 0, 1))
    assert targets.tolist() == [0, 1, 2]
    assert targets.dtype == torch.int64
    assert weights.dtype == torch.float64


def test_bare_grayscale_images() -> None:
    out = fast_collate([_image(0, (4, 5)), _image(1, (4, 5))])
    assert out.shape == (2, 1, 4, 5)
    assert torch.equal(out[1, 0], torch.from_numpy(_image(1, (4, 5))))


def test_pil_images() -> None:
    image_module = pytest.importorskip("PIL.Image")
    pil = image_module.fromarray(_image(3))
    out = fast_collate([(pil, 1)])[0]
    assert torch.equal(out[0], torch.from_numpy(_image(3)).permute(2, 0, 1))


@pytest.mark.parametrize(
    ("samples", "pattern"),
    [
        ([], r"empty batch"),
        (
            [_image(0), _image(1, (4, 6, 3))],
            r"image 1 has shape \(4, 6, 3\), image 0 has \(4, 5, 3\)",
        ),
        ([_image(0).astype(np.float32)], r"image 0 has dtype float32; it needs uint8"),
        ([np.zeros((2, 2, 2, 2), np.uint8)], r"image 0 has shape \(2, 2, 2, 2\)"),
    ],
)
def test_errors(samples: list[object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        fast_collate(samples)


def test_as_collate_fn_with_normalization_on_the_cpu() -> None:
    samples = [(_image(i), i) for i in range(6)]
    mean, std = (100.0, 110.0, 120.0), (50.0, 60.0, 70.0)
    loader = DataLoaderX(
        samples, batch_size=3, collate_fn=fast_collate, mean=mean, std=std, device="cpu"
    )
    batches = list(loader)
    assert len(batches) == 2
    images, targets = batches[1]
    raw = torch.stack([torch.from_numpy(_image(i)).permute(2, 0, 1) for i in range(3, 6)])
    expected = (raw.float() - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    torch.testing.assert_close(images, expected, rtol=0, atol=0)
    assert targets.tolist() == [3, 4, 5]
