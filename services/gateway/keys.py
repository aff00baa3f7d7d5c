"""API keys, stored only as SHA-256 hashes, with each key's tenant and rate limits.

The keys file (``--api-keys-file`` / ``TANDEM_API_KEYS_FILE``) is JSON::

    {"keys": [{"sha256": "<hex of sha256(key)>", "tenant": "acme",
               "tokens_per_window": 100000, "requests_per_window": 600, "window_seconds": 60,
               "slo_ttft_ms": 500, "slo_tpot_ms": 20}]}

``tenant`` defaults to ``t-`` and the first 12 hex digits of the hash; limits default to 0
(unlimited) and a 60 s window; ``slo_ttft_ms`` / ``slo_tpot_ms``, the tenant's latency
objectives, default to the gateway's ``--slo-ttft-ms`` / ``--slo-tpot-ms``
(`services.gateway.slo`: a request may still ask for its own).
``python -m services.gateway.keys KEY [--tenant T ...]`` prints the entry for a key, so the key
itself never has to be written down. A presented key is hashed and compared with every stored
hash with ``hmac.compare_digest``: no early exit, so timing tells nothing about which or how
many characters matched.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.slo import SloOverride, check_ms


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Per-tenant budget per window: input + output tokens, and requests (0: unlimited)."""

    tokens_per_window: int = 0
    requests_per_window: int = 0
    window_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.tokens_per_window < 0 or self.requests_per_window < 0:
            raise ValueError("limits must be >= 0")
        if self.window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")

    @property
    def limited(self) -> bool:
        return bool(self.tokens_per_window or self.requests_per_window)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key: the hex SHA-256 of the key (never the key), its tenant, limits and
    latency objectives (`services.gateway.slo`; None: the gateway's)."""

    sha256: str
    tenant: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    slo: SloOverride = field(default_factory=SloOverride)

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError("sha256 must be 64 lowercase hex digits")


def hash_key(key: str) -> str:
    """Hex SHA-256 of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_of_hash(digest: str) -> str:
    """The default tenant of a key: a short, stable id derived from its hash."""
    return "t-" + digest[:12]


def plain_keys(items: Iterable[str], limits: TenantLimits | None = None) -> tuple[ApiKey, ...]:
    """``key`` or ``key:tenant`` items (``--api-key``, ``TANDEM_API_KEYS``), hashed at once."""
    out = []
    for item in items:
        key, sep, tenant = item.strip().partition(":")
        if not key:
            raise ValueError(f"empty API key in {item!r}")
        digest = hash_key(key)
        out.append(ApiKey(digest, tenant if sep and tenant else tenant_of_hash(digest),
                          limits or TenantLimits()))  # fmt: skip
    return tuple(out)


def load_keys_file(path: str | Path) -> tuple[ApiKey, ...]:
    """The entries of a keys file (see the module docstring); ValueError names a bad entry."""
    raw = json.loads(Path(path).read_text())
    entries = raw.get("keys") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected an object with a 'keys' list")
    out = []
    for i, e in enumerate(entries):
        try:
            digest = str(e["sha256"]).lower()
            limits = TenantLimits(
                int(e.get("tokens_per_window", 0)),
                int(e.get("requests_per_window", 0)),
                float(e.get("window_seconds", 60.0)),
            )
            slo = SloOverride(*(_slo_ms(e, name) for name in ("slo_ttft_ms", "slo_tpot_ms")))
            tenant = str(e.get("tenant") or tenant_of_hash(digest))
            out.append(ApiKey(digest, tenant, limits, slo))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{path}: keys[{i}] is invalid: {err!r}") from err
    return tuple(out)


def _slo_ms(entry: dict[str, object], name: str) -> float | None:
    value = entry.get(name)
    return None if value is None else check_ms(float(value), name)  # type: ignore[arg-type]


def tenant_slos(keys: Sequence[ApiKey]) -> dict[str, SloOverride]:
    """Each tenant's objectives, from the keys that set some (a tenant's keys should agree;
    the last one listed wins where they do not)."""
    return {k.tenant: k.slo for k in keys if k.slo != SloOverride()}


class KeyRing:
    """Looks up presented keys among stored hashes in constant time per stored key."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self._keys = [(bytes.fromhex(k.sha256), k) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def find(self, presented: str) -> ApiKey | None:
        """The entry whose hash matches ``presented``, comparing against every entry."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for stored, key in self._keys:
            if hmac.compare_digest(stored, digest):
                found = key
        return found


def entry(key: str, tenant: str = "", tokens: int = 0, requests: int = 0,
          window: float = 60.0) -> dict[str, object]:  # fmt: skip
    """The keys-file entry for ``key`` (what ``python -m services.gateway.keys`` prints)."""
    digest = hash_key(key)
    out: dict[str, object] = {"sha256": digest, "tenant": tenant or tenant_of_hash(digest)}
    if tokens or requests:
        out |= {"tokens_per_window": tokens, "requests_per_window": requests,
                "window_seconds": window}  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.gateway.keys", description="Print the keys-file entry of a key."
    )
    p.add_argument("key")
    p.add_argument("--tenant", default="")
    p.add_argument("--tokens-per-window", type=int, default=0)
    p.add_argument("--requests-per-window", type=int, default=0)
    p.add_argument("--window-seconds", type=float, default=60.0)
    a = p.parse_args(argv)
    e = entry(a.key, a.tenant, a.tokens_per_window, a.requests_per_window, a.window_seconds)
    print(json.dumps(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
