"""Feeding batches from host memory and from disk to the step: the paths data that is not on the device takes.

`order` draws each epoch's order (a full permutation, or shuffled blocks for data read from disk),
`rows` gathers rows of host memory or a memory map, `stream` reads a cache larger than host memory
in blocks within a memory budget, `host` gathers batches (from either) on a thread into pinned buffers
and copies them to the device on a side stream, and `place` decides where the data lives when
`resident_max_gb` is `auto`.
"""
