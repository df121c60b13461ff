"""The serving front of an attention client: the OpenAI-compatible API and the engine behind it.

The engine (continuous batching over a paged KV cache): ``sampling`` (parameters and the sampler),
``blocks`` (the KV block allocator and prefix cache), ``scheduler`` (which sequences run each step),
``engine`` (one decoder step at a time, cut into ``micro_batches``), ``grammar`` (structured
outputs) — pure or single-threaded.
The front: ``serve`` (``AttentionService``: the HTTP service, placement swaps, readiness), ``http_api``
(request parsing, limits, errors, probes), ``completions`` and ``chat`` (the two APIs),
``responses`` and ``response_output`` (OpenAI's Responses API over the chat path), ``tools`` and
``reasoning`` (tool calls and thinking in chat answers), ``text_stream`` (incremental detokenising),
``engine_worker`` (the thread that owns the engine), ``batch_scheduler`` (static batching, the
baseline), ``metrics`` (Prometheus, with vLLM's names). Its command, ``eaas attention-client``, is in
``runtime/commands/``.

``runtime/client/`` is the attention client's data path under it: routing, remote experts, failover.
"""
