"""``dsv2-mlc serve``: an OpenAI-compatible HTTP server with continuous batching, prefix caching
and Prometheus metrics (FastAPI + uvicorn: ``pip install dsv2-mlc[serve]``); and
``dsv2-mlc bench-serve``, its load generator."""
