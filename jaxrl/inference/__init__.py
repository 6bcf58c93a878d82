"""Serving the model: the JetStream-API engine (prefill / insert / generate over decode slots), on-device
sampling, the continuous-batching scheduler, and the HTTP server (vLLM token route, OpenAI chat).

May import: `jaxrl.config`, `jaxrl.parallel`, `jaxrl.model`.
"""
