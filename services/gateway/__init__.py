"""The OpenAI-compatible HTTP gateway (FastAPI): ``python -m services.gateway --help``."""
