"""`fast_collate`: uint8 images to one ``N, C, H, W`` uint8 tensor, no float work on the CPU."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

_HWC = "H, W, C"
_CHW = "C, H, W"
_MAX_CHANNELS = 4
_ACCEPTED = "a numpy array or a PIL image (H, W, C or H, W) or a torch tensor (C, H, W or H, W)"


def fast_collate(samples: Sequence[Any]) -> Any:
    """Collate uint8 images into a uint8 ``N, C, H, W`` tensor, leaving the rest to torch.

    Use it as ``collate_fn`` with ``mean``/``std`` on the loader: the batch crosses to the
    device as uint8, a quarter of float32's bytes, and is normalized there.

    Each sample is an image, or a tuple or list whose first element is the image (``(image,
    target)``). Each kind of image is read in its own library's layout:

    - a numpy uint8 array: ``H, W, C`` or ``H, W``, as PIL, OpenCV and imageio decode them;
    - a PIL image: ``H, W, C`` or ``H, W``, as ``numpy.asarray`` reads it;
    - a torch uint8 CPU tensor: ``C, H, W`` or ``H, W``, as torchvision's ``PILToTensor`` and
      ``torchvision.io.decode_image`` make it.

    An ``H, W`` image has one channel. Views (crops, flips, permutes) are read as they are, each
    image is copied once, into the output, and nothing is converted to float. Anything else
    (nested lists, other array-likes) is refused rather than guessed at, and so is a batch that
    mixes torch tensors with numpy arrays or PIL images, which are laid out differently; numpy
    arrays and PIL images mix. So is an image whose shape puts it in the other layout: more
    than 4 channels where its kind has them and at most 4 at the other end, such as an
    ``H, W, C`` tensor (``permute(2, 0, 1)`` it) or a ``C, H, W`` array (``torch.from_numpy``
    it). The other elements of the samples are collated by `torch.utils.data.default_collate`.

    Args:
        samples: The samples of one batch, as the ``DataLoader`` hands them to ``collate_fn``.

    Returns:
        The image tensor for image samples, else a tuple: the image tensor, then the collated
        other elements.

    Raises:
        TypeError: An image that is none of the three kinds, or a batch that mixes torch tensors
            with numpy arrays or PIL images.
        ValueError: No samples, an image that is not uint8 or not 2-D/3-D, one whose shape
            puts it in the other layout, a tensor that is not a dense CPU tensor, or images of
            different shapes.

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> hwc = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)  # as decoded: H, W, C
        >>> images, targets = fast_collate([(hwc, 1), (hwc, 0)])
        >>> images.shape, images.dtype, targets.tolist()
        (torch.Size([2, 3, 4, 5]), torch.uint8, [1, 0])

        The same image as a torch tensor, ``C, H, W`` as torchvision makes it, gives the same
        batch:

        >>> chw = torch.from_numpy(hwc).permute(2, 0, 1)
        >>> torch.equal(fast_collate([(chw, 1), (chw, 0)])[0], images)
        True
        >>> fast_collate([hwc, chw])  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
            ...
        TypeError: fast_collate: image 1 is a torch.Tensor (C, H, W) but image 0 is a
        numpy.ndarray (H, W, C); one batch takes one layout.
    """
    if len(samples) == 0:
        raise ValueError("fast_collate got an empty batch.")
    with_rest = isinstance(samples[0], (tuple, list))
    images = [s[0] if with_rest else s for s in samples]
    first, first_layout = _as_3d(images[0], 0)
    if first_layout == _CHW:
        out_shape = first.shape
    else:
        out_shape = (first.shape[2], first.shape[0], first.shape[1])
    out = torch.empty((len(images), *out_shape), dtype=torch.uint8)
    # Written through a numpy view of the output: one copy per image, from any strides (crops,
    # flips, permuted tensors), and read-only sources (PIL's arrays) are fine.
    out_view = out.numpy()
    for i, image in enumerate(images):
        array, layout = (first, first_layout) if i == 0 else _as_3d(image, i)
        if layout != first_layout:
            # Each layout is right for its own kind, but a dataset that yields both most likely
            # made one of them by hand, in the other's layout; the shapes may even agree.
            raise TypeError(
                f"fast_collate: image {i} is a {_type_name(image)} ({layout}) but image 0 is a "
                f"{_type_name(images[0])} ({first_layout}); one batch takes one layout."
            )
        if array.shape != first.shape:
            raise ValueError(
                f"fast_collate: image {i} has shape {array.shape}, image 0 has "
                f"{first.shape} ({layout}); all images of a batch must match."
            )
        out_view[i] = array if layout == _CHW else array.transpose(2, 0, 1)
    if not with_rest:
        return out
    rest = default_collate([tuple(s[1:]) for s in samples])
    return (out, *rest)


def _as_3d(image: Any, index: int) -> tuple[np.ndarray[Any, Any], str]:
    """A 3-D numpy view of ``image`` in its own layout, and that layout (``_HWC`` or ``_CHW``).

    An ``H, W`` image gets its channel dim of 1 here, after its shape was checked as given.
    """
    if isinstance(image, torch.Tensor):
        array = _tensor_as_array(image, index)
        layout = _CHW
    elif isinstance(image, np.ndarray) or _is_pil_image(image):
        array = np.asarray(image)
        layout = _HWC
    else:
        raise TypeError(
            f"fast_collate: image {index} is a {_type_name(image)}; it needs {_ACCEPTED}."
        )
    if array.dtype != np.uint8:
        raise ValueError(f"fast_collate: image {index} has dtype {array.dtype}; it needs uint8.")
    if array.ndim == 2:
        array = array[None] if layout == _CHW else array[:, :, None]
    elif array.ndim != 3:
        raise ValueError(
            f"fast_collate: image {index} has shape {array.shape}; it needs {layout} or H, W."
        )
    else:
        _refuse_swapped(image, array.shape, layout, index)
    return array, layout


def _refuse_swapped(image: Any, shape: tuple[int, ...], layout: str, index: int) -> None:
    """Refuse a 3-D image whose shape says it is in the other kind's layout.

    An image has 1 to 4 channels (gray, gray and alpha, RGB, RGBA). More than 4 where the
    channels should be, and at most 4 at the other end, is an ``H, W, C`` tensor (a
    ``TensorDataset`` of decoded images) or a ``C, H, W`` array (timm's ``ToNumpy``): read as
    they are, their height would become channels, silently when nothing checks the channel count.
    """
    channels, other_end = (shape[0], shape[2]) if layout == _CHW else (shape[2], shape[0])
    if channels <= _MAX_CHANNELS or other_end > _MAX_CHANNELS:
        return
    if layout == _CHW:
        fix = "torch tensors are read as C, H, W, as torchvision makes them: pass "
        fix += "tensor.permute(2, 0, 1)."
    else:
        fix = "numpy arrays are read as H, W, C, as PIL decodes them: pass "
        fix += "torch.from_numpy(array) or array.transpose(1, 2, 0)."
    other = _HWC if layout == _CHW else _CHW
    raise ValueError(
        f"fast_collate: image {index} is a {_type_name(image)} of shape {shape}, which looks "
        f"like {other}; {fix}"
    )


def _tensor_as_array(image: torch.Tensor, index: int) -> np.ndarray[Any, Any]:
    """The numpy view of a tensor that shares its memory, or an error saying why there is none."""
    if image.dtype != torch.uint8:
        raise ValueError(
            f"fast_collate: image {index} is a torch.Tensor of dtype {image.dtype}; it needs "
            f"torch.uint8."
        )
    if image.device.type != "cpu":
        # Collating runs in the DataLoader's workers; the device stage does the copy after it.
        raise ValueError(
            f"fast_collate: image {index} is a torch.Tensor on {image.device}; it needs a CPU "
            f"tensor."
        )
    if image.layout != torch.strided:
        raise ValueError(
            f"fast_collate: image {index} is a torch.Tensor with layout {image.layout}; it needs "
            f"a dense (torch.strided) tensor."
        )
    return image.numpy()


def _is_pil_image(image: Any) -> bool:
    # PIL is optional: until something imports it, nothing can be a PIL image, and importing
    # it only to check would load it into every worker of a loader that never uses it.
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(image, pil.Image)


def _type_name(value: Any) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    # Subclasses (torchvision's tv_tensors, PIL's per-format images) by the name users know.
    if isinstance(value, torch.Tensor):
        return "torch.Tensor"
    if _is_pil_image(value):
        return "PIL.Image.Image"
    return f"{kind.__module__}.{kind.__qualname__}"
