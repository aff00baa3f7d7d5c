"""LoRA adapters of the engine: load, unload (after the requests using them finish), list."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import AdapterNotFoundError, InvalidAdapterError
from engine.lora_config import LoRASpec

if TYPE_CHECKING:
    import threading

    from engine.choices import Request
    from engine.model_runner import ModelRunner


class Adapters:
    """The LoRA adapters of one engine (``EngineConfig.enable_lora``), a part it holds.

    ``runner`` holds the adapters' weights; ``requests`` is the engine's table of live requests
    (read: an adapter is freed only once none uses it); ``lock`` is the engine's lock, held
    around every change (callers that already hold it may call in: it is reentrant)."""

    def __init__(
        self, runner: ModelRunner, lock: threading.RLock, requests: dict[str, Request]
    ) -> None:
        self.runner = runner
        self._lock = lock
        self._requests = requests
        self._unloading: set[str] = set()  # unloaded once their requests finish

    def add(self, name: str, path: str) -> LoRASpec:
        """Load a PEFT adapter folder under ``name``; requests then name it as their adapter.

        Raises InvalidAdapterError with the reason when the folder cannot be served."""
        manager = self.runner.lora
        if manager is None:
            raise InvalidAdapterError("LoRA is not enabled on this engine (enable_lora)")
        with self._lock:
            if name in self._unloading:
                raise InvalidAdapterError(f"adapter {name!r} is still being unloaded; retry")
            return self.runner.add_lora(name, path)

    def remove(self, name: str) -> None:
        """Unload an adapter. New requests for it fail at once; requests already using it
        finish first, then its memory is freed. Raises AdapterNotFoundError if not loaded."""
        with self._lock:
            self.check(name)
            self._unloading.add(name)
            self.drop_unused()

    def names(self) -> list[str]:
        """Names of the loaded adapters (not those being unloaded)."""
        manager = self.runner.lora
        with self._lock:
            names = manager.names() if manager is not None else []
            return [n for n in names if n not in self._unloading]

    def resident(self) -> list[str]:
        """Adapters in device slots now, least recently used first."""
        manager = self.runner.lora
        return manager.resident() if manager is not None else []

    def check(self, name: str | None) -> str:
        """``name`` if it is a loaded adapter ("" for None or ""); else AdapterNotFoundError."""
        if not name:
            return ""
        manager = self.runner.lora
        if manager is None or name not in manager.specs or name in self._unloading:
            raise AdapterNotFoundError(f"the adapter `{name}` is not loaded")
        return name

    def drop_unused(self) -> None:
        """Free adapters being unloaded that no live request uses any more (lock held)."""
        if not self._unloading or self.runner.lora is None:
            return
        used = {req.parent.lora for req in self._requests.values()}
        for name in sorted(self._unloading - used):
            self.runner.remove_lora(name)
            self._unloading.discard(name)
