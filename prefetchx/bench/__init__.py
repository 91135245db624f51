"""The tool that measures prefetchx: ``python -m prefetchx bench`` and the benchmark programs.

`paired` runs arms in paired rounds and takes their ratios within each round, `synthetic` times
a synthetic training loop (the thread stage against a plain ``DataLoader``, the
``BackgroundGenerator`` recipe and the floor of a threaded hand-off, held against the shortest
epoch any prefetcher could make), `jpeg` a JPEG-decoding CPU workload, `cuda` the copy bandwidth
and an end-to-end step on a GPU, `plot` draws a run's record, `record` writes the benchmark
programs' tables and records, and `cli` runs them as the ``bench`` command. None of it is
imported by the library.
"""
