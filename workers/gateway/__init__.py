"""splitserve behind a cluster's Gateway (Gateway API Inference Extension).

- ``epp``: the endpoint picker, an Envoy ext_proc server that picks each request's pod with the
  router's own pools, discovery, policies and generation pairing (one pick, two fronts).
- ``sidecar``: the decode-side P/D proxy that runs the prefill and decode legs when the picker
  names a prefill pod in ``x-prefiller-host-port``.
- ``envoy``: a static Envoy bootstrap for the local stack and the tests.
"""
