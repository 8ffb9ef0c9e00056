"""Data-parallel routing: which engine replica takes a request. The policies (``policies``), a prompt's
block hashes (``prompt``), each replica's cache as its KV events tell it (``kv_index``) and the set of
replicas an app follows (``replicas``)."""
