"""LoRA adapters of the engine: load, unload (after the requests using them finish), list."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import AdapterNotFoundError, InvalidAdapterError
from engine.lora_config import LoRASpec

if TYPE_CHECKING:
    import threading

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner


class AdapterMixin:
    """Methods of ``LLMEngine`` for LoRA adapters (``EngineConfig.enable_lora``)."""

    # Provided by LLMEngine.
    config: EngineConfig
    runner: ModelRunner
    _lock: threading.RLock
    _requests: dict
    _unloading: set[str]

    def add_lora(self, name: str, path: str) -> LoRASpec:
        """Load a PEFT adapter folder under ``name``; requests then name it as their adapter.

        Raises InvalidAdapterError with the reason when the folder cannot be served."""
        manager = self.runner.lora
        if manager is None:
            raise InvalidAdapterError("LoRA is not enabled on this engine (enable_lora)")
        with self._lock:
            if name in self._unloading:
                raise InvalidAdapterError(f"adapter {name!r} is still being unloaded; retry")
            return self.runner.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter. New requests for it fail at once; requests already using it
        finish first, then its memory is freed. Raises AdapterNotFoundError if not loaded."""
        with self._lock:
            self.check_lora(name)
            self._unloading.add(name)
            self._drop_unused_loras()

    def list_loras(self) -> list[str]:
        """Names of the loaded adapters (not those being unloaded)."""
        manager = self.runner.lora
        with self._lock:
            names = manager.names() if manager is not None else []
            return [n for n in names if n not in self._unloading]

    def resident_loras(self) -> list[str]:
        """Adapters in device slots now, least recently used first."""
        manager = self.runner.lora
        return manager.resident() if manager is not None else []

    def check_lora(self, name: str | None) -> str:
        """``name`` if it is a loaded adapter ("" for None or ""); else AdapterNotFoundError."""
        if not name:
            return ""
        manager = self.runner.lora
        if manager is None or name not in manager.specs or name in self._unloading:
            raise AdapterNotFoundError(f"the adapter `{name}` is not loaded")
        return name

    def _drop_unused_loras(self) -> None:
        """Free adapters being unloaded that no live request uses any more."""
        if not self._unloading or self.runner.lora is None:
            return
        used = {req.parent.lora for req in self._requests.values()}
        for name in sorted(self._unloading - used):
            self.runner.remove_lora(name)
            self._unloading.discard(name)
