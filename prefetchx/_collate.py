"""`fast_collate`: uint8 images to one ``N, C, H, W`` uint8 tensor, no float work on the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate


def fast_collate(samples: Sequence[Any]) -> Any:
    """Collate uint8 images into a uint8 ``N, C, H, W`` tensor, leaving the rest to torch.

    Use it as ``collate_fn`` with ``mean``/``std`` on the loader: the batch crosses to the
    device as uint8, a quarter of float32's bytes, and is normalized there.

    Each sample is an image, or a tuple or list whose first element is the image (``(image,
    target)``). An image is a numpy ``H, W, C`` or ``H, W`` uint8 array or anything
    ``numpy.asarray`` turns into one, such as a PIL image. The other elements of the samples are
    collated by `torch.utils.data.default_collate`.

    Returns:
        The image tensor for image samples, else a tuple: the image tensor, then the collated
        other elements.

    Raises:
        ValueError: No samples, an image that is not uint8 or not 2-D/3-D, or images of
            different shapes.

    Examples:
        >>> import numpy as np
        >>> batch = [(np.zeros((4, 5, 3), np.uint8), 1), (np.ones((4, 5, 3), np.uint8), 0)]
        >>> images, targets = fast_collate(batch)
        >>> images.shape, images.dtype, targets.tolist()
        (torch.Size([2, 3, 4, 5]), torch.uint8, [1, 0])
    """
    if len(samples) == 0:
        raise ValueError("fast_collate got an empty batch.")
    with_rest = isinstance(samples[0], (tuple, list))
    images = [s[0] if with_rest else s for s in samples]
    first = _as_hwc(images[0], 0)
    out = torch.empty(
        (len(images), first.shape[2], first.shape[0], first.shape[1]), dtype=torch.uint8
    )
    # Written through a numpy view of the output: one copy, and read-only arrays (PIL's) are fine.
    out_view = out.numpy()
    for i, image in enumerate(images):
        array = first if i == 0 else _as_hwc(image, i)
        if array.shape != first.shape:
            raise ValueError(
                f"fast_collate: image {i} has shape {array.shape}, image 0 has "
                f"{first.shape}; all images of a batch must match."
            )
        out_view[i] = array.transpose(2, 0, 1)
    if not with_rest:
        return out
    rest = default_collate([tuple(s[1:]) for s in samples])
    return (out, *rest)


def _as_hwc(image: Any, index: int) -> np.ndarray[Any, Any]:
    array = np.asarray(image)
    if array.dtype != np.uint8:
        raise ValueError(f"fast_collate: image {index} has dtype {array.dtype}; it needs uint8.")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise ValueError(
            f"fast_collate: image {index} has shape {array.shape}; it needs H, W, C or H, W."
        )
    return array
