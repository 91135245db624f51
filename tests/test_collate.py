"""fast_collate: uint8 images to N, C, H, W uint8 without float work."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

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
    pil = _pil(_image(3))
    out = fast_collate([(pil, 1)])[0]
    assert torch.equal(out[0], torch.from_numpy(_image(3)).permute(2, 0, 1))


def _pil(array: np.ndarray) -> Any:  # type: ignore[type-arg]
    return pytest.importorskip("PIL.Image").fromarray(array)


def _as_torchvision(image: Any) -> torch.Tensor:
    """``image`` as torchvision's ``PILToTensor`` makes it: uint8, C, H, W, a permuted view."""
    array = np.array(image)  # a writable copy, as torchvision's: torch warns on read-only ones
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1)


def _as(kind: str, array: np.ndarray) -> Any:  # type: ignore[type-arg]
    """The H, W, C (or H, W) ``array`` as a ``kind`` image: numpy, PIL or torch (C, H, W)."""
    if kind == "pil":
        return _pil(array)
    if kind == "torch":
        return _as_torchvision(array)
    return array


# H, W and C all differ, so any mix-up of two axes changes the shape (RGB, RGBA and L images).
@pytest.mark.parametrize("shape", [(4, 5, 3), (6, 2, 4), (4, 5)])
def test_pil_numpy_and_torch_give_the_same_batch(shape: tuple[int, ...]) -> None:
    pils = [_pil(_image(i, shape)) for i in range(3)]
    expected = torch.stack([_as_torchvision(pil) for pil in pils])
    batches = {
        "pil": fast_collate([(pil, i) for i, pil in enumerate(pils)]),
        "numpy": fast_collate([(np.asarray(pil), i) for i, pil in enumerate(pils)]),
        "torch": fast_collate([(_as_torchvision(pil), i) for i, pil in enumerate(pils)]),
    }
    for kind, (images, targets) in batches.items():
        assert images.dtype == torch.uint8, kind
        assert images.shape == expected.shape, kind
        assert torch.equal(images, expected), kind
        assert targets.tolist() == [0, 1, 2], kind


def test_torch_grayscale_h_w_tensors() -> None:
    tensors = [torch.from_numpy(_image(i, (4, 5))) for i in range(2)]
    out = fast_collate(tensors)
    assert out.shape == (2, 1, 4, 5)
    assert torch.equal(out[:, 0], torch.stack(tensors))


def test_numpy_and_pil_images_mix_in_one_batch() -> None:
    # Both are H, W, C: a dataset may return either and the layout is the same.
    out = fast_collate([_image(0), _pil(_image(1))])
    assert torch.equal(out, torch.stack([_as_torchvision(_image(i)) for i in range(2)]))


_BIG = _image(7, (8, 9, 3))
_BIG_CHW = torch.from_numpy(_BIG).permute(2, 0, 1)


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(_BIG[2:6, 1:6], id="numpy-crop"),
        pytest.param(_BIG[:, ::-1], id="numpy-hflip"),
        pytest.param(_BIG[::-1, ::2], id="numpy-vflip-strided"),
        pytest.param(_BIG[..., ::-1], id="numpy-bgr"),
        pytest.param(_BIG[:, :, 0], id="numpy-one-channel"),
        pytest.param(_BIG.transpose(1, 0, 2), id="numpy-transposed"),
        pytest.param(_BIG_CHW, id="torch-permuted"),
        pytest.param(_BIG_CHW[:, 2:6, 1:6], id="torch-crop"),
        pytest.param(_BIG_CHW[:, ::3, ::2], id="torch-strided"),
        pytest.param(_BIG_CHW[1], id="torch-one-channel"),
        pytest.param(_BIG_CHW.transpose(1, 2), id="torch-transposed"),
    ],
)
def test_non_contiguous_views(view: Any) -> None:
    if isinstance(view, np.ndarray):
        assert not view.flags.c_contiguous
        chw = torch.from_numpy(np.ascontiguousarray(view))
        chw = chw.permute(2, 0, 1) if chw.dim() == 3 else chw[None]
    else:
        assert not view.is_contiguous()
        chw = view if view.dim() == 3 else view[None]
    out = fast_collate([view, view])
    assert out.is_contiguous()
    assert torch.equal(out, torch.stack([chw, chw]))


def _assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual == expected


@pytest.mark.parametrize("kind", ["numpy", "pil", "torch"])
def test_other_elements_are_what_default_collate_gives(kind: str) -> None:
    samples = [
        (
            _as(kind, _image(i)),
            i,
            i / 3,
            torch.full((2,), i, dtype=torch.int16),
            np.arange(3, dtype=np.float32) + i,
            {"label": i, "name": f"n{i}", "box": torch.tensor([i, i + 1.5])},
            (True, [i, i + 1]),
        )
        for i in range(3)
    ]
    images, *rest = fast_collate(samples)
    assert torch.equal(images, torch.stack([_as_torchvision(_image(i)) for i in range(3)]))
    _assert_same(rest, default_collate([s[1:] for s in samples]))


class _ArrayLike:
    """Neither a numpy array, a PIL image nor a torch tensor, but ``numpy.asarray`` reads it."""

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:  # type: ignore[type-arg]
        return _image(0)


@pytest.mark.parametrize(
    ("image", "pattern"),
    [
        pytest.param(
            [[np.uint8(1), np.uint8(2)], [np.uint8(3), np.uint8(4)]],
            r"image 1 is a list; it needs a numpy array or a PIL image \(H, W, C or H, W\) or a "
            r"torch tensor \(C, H, W or H, W\)\.",
            id="nested-list",
        ),
        pytest.param(
            _ArrayLike(), r"image 1 is a test_collate\._ArrayLike; it needs", id="__array__"
        ),
        pytest.param(memoryview(_image(0)), r"image 1 is a memoryview; it needs", id="memoryview"),
    ],
)
def test_array_likes_of_unknown_layout_are_refused(image: object, pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        fast_collate([(_image(0), 0), (image, 1)])


@pytest.mark.parametrize(
    ("kinds", "pattern"),
    [
        pytest.param(
            ["numpy", "torch"],
            r"image 1 is a torch\.Tensor \(C, H, W\) but image 0 is a numpy\.ndarray "
            r"\(H, W, C\); one batch takes one layout\.",
            id="numpy-torch",
        ),
        pytest.param(
            ["torch", "torch", "pil"],
            r"image 2 is a PIL\.Image\.Image \(H, W, C\) but image 0 is a torch\.Tensor "
            r"\(C, H, W\)",
            id="torch-pil",
        ),
    ],
)
def test_torch_mixed_with_numpy_or_pil_is_refused(kinds: list[str], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        fast_collate([_as(kind, _image(i)) for i, kind in enumerate(kinds)])


@pytest.mark.parametrize(
    ("tensor", "pattern"),
    [
        pytest.param(
            torch.zeros(3, 4, 5),
            r"image 0 is a torch\.Tensor of dtype torch\.float32; it needs torch\.uint8\.",
            id="float32",
        ),
        pytest.param(
            torch.zeros(3, 4, 5, dtype=torch.uint8, device="meta"),
            r"image 0 is a torch\.Tensor on meta; it needs a CPU tensor\.",
            id="meta",
        ),
        pytest.param(
            torch.zeros(3, 4, 5, dtype=torch.uint8).to_sparse(),
            r"image 0 is a torch\.Tensor with layout torch\.sparse_coo; it needs a dense",
            id="sparse",
        ),
        pytest.param(
            torch.zeros(4, dtype=torch.uint8),
            r"image 0 has shape \(4,\); it needs C, H, W or H, W",
            id="1-d",
        ),
    ],
)
def test_tensors_it_cannot_read_are_refused(tensor: torch.Tensor, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        fast_collate([tensor])


@pytest.mark.parametrize(
    ("image", "pattern"),
    [
        pytest.param(
            torch.zeros(32, 30, 3, dtype=torch.uint8),
            r"image 0 is a torch\.Tensor of shape \(32, 30, 3\), which looks like H, W, C; "
            r"torch tensors are read as C, H, W, as torchvision makes them: pass "
            r"tensor\.permute\(2, 0, 1\)\.",
            id="torch-h-w-c",
        ),
        pytest.param(
            np.zeros((3, 32, 30), np.uint8),
            r"image 0 is a numpy\.ndarray of shape \(3, 32, 30\), which looks like C, H, W; "
            r"numpy arrays are read as H, W, C, as PIL decodes them: pass "
            r"torch\.from_numpy\(array\) or array\.transpose\(1, 2, 0\)\.",
            id="numpy-c-h-w",
        ),
    ],
)
def test_an_image_in_the_other_layout_is_refused(image: object, pattern: str) -> None:
    # What a TensorDataset of decoded H, W, C images, or timm's ToNumpy, hands fast_collate.
    with pytest.raises(ValueError, match=pattern):
        fast_collate([image])


@pytest.mark.parametrize(
    "image",
    [
        pytest.param(torch.zeros(5, 6, 7, dtype=torch.uint8), id="torch-5-channels"),
        pytest.param(torch.zeros(3, 2, 2, dtype=torch.uint8), id="torch-tiny"),
        pytest.param(np.zeros((5, 6, 8), np.uint8), id="numpy-8-channels"),
        pytest.param(np.zeros((2, 2, 3), np.uint8), id="numpy-tiny"),
    ],
)
def test_many_channels_or_tiny_images_are_not_taken_for_the_other_layout(image: Any) -> None:
    # Only more than 4 channels on one end and at most 4 on the other looks swapped.
    out = fast_collate([image])
    expected = torch.as_tensor(image)
    if isinstance(image, np.ndarray):
        expected = expected.permute(2, 0, 1)
    assert torch.equal(out[0], expected)


@pytest.mark.cuda
def test_cuda_tensors_are_refused() -> None:
    tensor = torch.zeros(3, 4, 5, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"image 0 is a torch\.Tensor on cuda:0; it needs a CPU"):
        fast_collate([tensor])


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
