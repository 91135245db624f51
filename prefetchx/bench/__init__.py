"""The tool that measures prefetchx: ``python -m prefetchx bench`` and the benchmark programs.

`synthetic` times a synthetic training loop (the thread stage against a plain ``DataLoader`` and
the ``BackgroundGenerator`` recipe), `jpeg` a JPEG-decoding CPU workload, `cuda` the copy
bandwidth and an end-to-end step on a GPU, `plot` draws a run's record, and `cli` runs them as
the ``bench`` command. None of it is imported by the library.
"""
