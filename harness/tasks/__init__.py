"""Training tasks shared by the demo, the examples and the benchmarks.

- :mod:`harness.tasks.stdlib_text`: real text that ships with every Python, the source files
  of its standard library, split by file into training and held-out sets, served as byte batches
  that are the same on every machine for the same seed.
- :mod:`harness.tasks.byte_lm`: a small decoder-only transformer over those bytes, AdamW with
  warmup and cosine decay, and the held-out loss in bits per byte.
"""
