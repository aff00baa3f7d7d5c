"""Per-request service-level objectives: the TTFT and TPOT a request should meet.

The router uses them to choose, per request, where its prompt is computed (a prefill worker and
a hand-off, or the decode worker itself: `services.router.disagg`), and the gateway's goodput
counts a request against its own SLOs. Most specific wins, field by field::

    the request's body (``slo_ttft_ms`` / ``slo_tpot_ms``, what an OpenAI client sends as
    ``extra_body``)  >  its headers (``x-tandem-slo-ttft-ms`` / ``x-tandem-slo-tpot-ms``)
    >  its tenant's (the keys file's ``slo_ttft_ms`` / ``slo_tpot_ms``)
    >  the gateway's ``--slo-ttft-ms`` / ``--slo-tpot-ms``

A value must be a number of milliseconds in (0, `MAX_SLO_MS`]; anything else is a 400 naming
the field or header.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.gateway.core import APIError

TTFT_HEADER = "x-tandem-slo-ttft-ms"
TPOT_HEADER = "x-tandem-slo-tpot-ms"
MAX_SLO_MS = 3_600_000.0  # an hour: past the longest request timeout, so never binding


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's objectives in milliseconds (both > 0)."""

    ttft_ms: float
    tpot_ms: float

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000


@dataclass(frozen=True, slots=True)
class SloOverride:
    """Objectives that replace the defaults where given (None: keep the default)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def over(self, base: Slo) -> Slo:
        return Slo(
            base.ttft_ms if self.ttft_ms is None else self.ttft_ms,
            base.tpot_ms if self.tpot_ms is None else self.tpot_ms,
        )


def check_ms(value: float, name: str) -> float:
    """``value`` when it is a valid objective; ValueError naming ``name`` otherwise."""
    if not (math.isfinite(value) and 0 < value <= MAX_SLO_MS):
        raise ValueError(f"{name} must be a number of milliseconds in (0, {MAX_SLO_MS:g}] "
                         f"(got {value!r})")  # fmt: skip
    return float(value)


def _field(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    try:
        return check_ms(value, name)
    except ValueError as e:
        raise APIError(400, str(e), param=name, code="invalid_slo") from e


def _header(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    return _field(value, name)


def request_slo(
    default: Slo,
    tenant: SloOverride | None,
    headers: Mapping[str, str],
    ttft_ms: float | None,
    tpot_ms: float | None,
) -> Slo:
    """The objectives of one request (the module docstring's order); APIError 400 for an invalid
    header or body value. ``ttft_ms`` / ``tpot_ms``: the body's fields (None: not given)."""
    slo = tenant.over(default) if tenant is not None else default
    from_headers = SloOverride(_header(headers, TTFT_HEADER), _header(headers, TPOT_HEADER))
    from_body = SloOverride(_field(ttft_ms, "slo_ttft_ms"), _field(tpot_ms, "slo_tpot_ms"))
    return from_body.over(from_headers.over(slo))
