"""swakv workers: a model shard on a paged KV cache, fed block-table deltas. Import submodules directly
(``workers.worker``, ``workers.attention``...); this package import stays free of torch."""
