"""The serving engine without Ray: the scheduler, the KV-cache manager and an executor of steps
(``engine``), how one is built from a model and its arguments (``build``), the in-process executor
(``executor``), the offline ``LLM`` facade (``llm``), text <-> token ids (``tokenizer``) and the
KV-event schema a router reads
(``kv_events``). Nothing here imports Ray, the router or the HTTP edge."""
