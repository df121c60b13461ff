"""The serving engine of the attention client: continuous batching over a paged KV cache.

``sampling`` (parameters and the sampler), ``blocks`` (the KV block allocator), ``scheduler``
(which sequences run each step), ``engine`` (one decoder step at a time) are pure or
single-threaded; the HTTP service (``runtime/client/serve.py``) drives the engine from one thread.
"""
