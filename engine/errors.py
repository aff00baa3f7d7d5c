"""Typed engine errors. Each message says what was wrong and what the limit or fix is."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of every error Tandem raises on purpose."""


class InvalidRequestError(TandemError, ValueError):
    """The request cannot be served as given (bad value, too long, ...)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus max_tokens) does not fit in the model context or the KV cache."""


class UnsupportedModelError(TandemError):
    """The model folder names an architecture or setting the engine does not implement."""


class RequestNotFoundError(TandemError, KeyError):
    """No live request with that id."""


class KVCapacityError(TandemError):
    """No free KV blocks for this request right now (transient; retry elsewhere or later)."""


class InsufficientMemoryError(TandemError):
    """The engine's share of the device cannot hold the weights, the activations and the
    smallest useful KV pool; raised at start, with the numbers, instead of an OOM later."""


class InvalidAdapterError(InvalidRequestError):
    """A LoRA adapter folder cannot be served: missing files, another base model's shapes, a
    rank over the limit, or targets and PEFT options the engine does not implement."""


class AdapterNotFoundError(TandemError, LookupError):
    """A request or an unload names a LoRA adapter that is not loaded."""


class UnsupportedConfigError(TandemError):
    """An engine option this device or build cannot run (FP8 on a GPU without it, ...)."""
