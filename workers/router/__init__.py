"""The KV-transfer router: the data plane's OpenAI-compatible front door.

It runs vLLM's prefill/decode protocol (a prefill leg with ``max_tokens=1`` and
``kv_transfer_params.do_remote_decode``, then the original request to a decode worker with the
returned ``kv_transfer_params``), falls back to aggregated serving on decode whenever disaggregation
cannot work, and exposes the queue metrics the autoscaler reads. Build one with
:func:`splitserve.router.app.build_app`; run it with ``splitserve router``.
"""
