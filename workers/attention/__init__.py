"""Window-aware paged attention over the block-table KV cache: the API, its checks and the K/V write in
``paged``, the CPU backend in ``torch_paged``, the Triton kernel in ``triton_paged``.
``from workers.attention import paged_attention``."""
from .paged import BACKEND_ENV, BACKENDS, paged_attention, select_backend, store_kv
from .torch_paged import first_key_position

__all__ = ["BACKEND_ENV", "BACKENDS", "first_key_position", "paged_attention", "select_backend", "store_kv"]
