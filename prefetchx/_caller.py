"""Where prefetchx's warnings point: at the first caller outside the library."""

from __future__ import annotations

import os
import sys
import warnings

PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
"""The directory of prefetchx's own modules, as their frames' file names begin."""


def warn(
    message: str, category: type[Warning] = UserWarning, *, skip: tuple[str, ...] = ()
) -> None:
    """Warn at the first frame outside prefetchx and outside the directories in ``skip``.

    However deep in the library (or in a framework in ``skip``) the cause was found, the
    warning names the caller's line, where ``warnings`` filters and ``pytest.warns`` see it. A
    warning raised in a producer thread points where that thread began; the thread stage shows
    it in the caller's thread with the batch it came with.
    """
    prefixes = (PACKAGE, *skip)
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, stacklevel=2, skip_file_prefixes=prefixes)
        return
    # What skip_file_prefixes does from Python 3.12 on: count the frames to skip.
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
