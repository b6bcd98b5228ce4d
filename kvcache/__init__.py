"""Plain-Python paged KV-cache bookkeeping: blocks, LRU free queue, block pool, prefix hashing,
per-request block tables.

No torch here (a test checks it): this package decides which block ids hold which tokens; the
engine owns the tensors those ids index.
"""
