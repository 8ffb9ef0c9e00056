"""swakv workers: a model shard on a paged KV cache, fed block-table deltas; and simulated ones.

``protocol`` (the engine <-> worker messages) and ``wire`` (their msgpack codec) are the contract;
``runtime`` runs a real shard on a device, ``sim`` models devices and models without one, ``attention``
holds the kernels and ``models`` turns a model's config into attention specs. Import submodules directly;
this package import stays free of torch."""
