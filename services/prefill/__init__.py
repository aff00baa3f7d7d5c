"""Prefill worker: chunked prefills in a continuous batch; holds KV for the decode side."""
