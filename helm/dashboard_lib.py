"""Plain-JSON builders of Grafana dashboards (schema 39): panels, a grid layout, and the
template variables every Tandem dashboard has (datasource, namespace, model, worker).

Used by ``helm/generate_dashboards.py``; no Grafana SDK, so the only input is this code and the
only output is the JSON the chart ships.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Every query selects on the three template variables; `namespace` is the Kubernetes namespace
# (Prometheus target label), `model` and `worker` are labels every Tandem process adds itself.
SEL = 'namespace=~"$namespace", model=~"$model", worker=~"$worker"'
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def sel(extra: str = "") -> str:
    """The label selector body: the template variables plus ``extra`` matchers."""
    return f"{SEL}, {extra}" if extra else SEL


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{{{sel(extra)}}}[{RATE}])"


def quantile(q: float, histogram: str, by: str = "", extra: str = "") -> str:
    """``histogram_quantile`` of a ``*_seconds`` (or other) histogram, grouped ``by``."""
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket', extra)}))"


def ratio(numerator: str, denominator: str) -> str:
    """``numerator / denominator`` that is 0, not empty, when the denominator is 0."""
    return f"({numerator}) / clamp_min({denominator}, 1e-9)"


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True, slots=True)
class Panel:
    """One panel: every panel has a title, a unit and a description."""

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"  # or "stat", "table"
    width: int = 12
    height: int = 8
    stacked: bool = False


@dataclass(slots=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)

    def row(self, title: str, *panels: Panel) -> Dashboard:
        self.rows.append((title, list(panels)))
        return self

    def to_json(self) -> dict[str, Any]:
        panels: list[dict[str, Any]] = []
        y, next_id = 0, 1
        for title, row_panels in self.rows:
            panels.append(_row(title, next_id, y))
            next_id += 1
            y += 1
            x, row_height = 0, 0
            for p in row_panels:
                if x + p.width > 24:
                    x, y = 0, y + row_height
                    row_height = 0
                panels.append(_panel(p, next_id, x, y))
                next_id += 1
                x += p.width
                row_height = max(row_height, p.height)
            y += row_height
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["tandem"],
            "timezone": "browser",
            "editable": True,
            "graphTooltip": 1,
            "refresh": "30s",
            "schemaVersion": 39,
            "version": 1,
            "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": _variables()},
            "annotations": {"list": []},
            "links": [],
            "panels": panels,
        }


def _row(title: str, panel_id: int, y: int) -> dict[str, Any]:
    return {
        "type": "row",
        "title": title,
        "id": panel_id,
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "panels": [],
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {}
    if p.kind == "timeseries":
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        if p.stacked:
            custom["stacking"] = {"mode": "normal", "group": "A"}
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr,
         "legendFormat": t.legend or "__auto", "range": p.kind != "table",
         "instant": p.kind == "table"}
        for i, t in enumerate(p.targets)
    ]  # fmt: skip
    return {
        "type": p.kind,
        "id": panel_id,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": targets,
    }


def _query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-query"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


# The metric every Tandem process exports (value 1), so the variables list every process.
VARIABLE_METRIC = "tandem_build_info"


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Prometheus",
            "query": "prometheus",
            "current": {},
        },
        _query_variable("namespace", "Namespace", f"label_values({VARIABLE_METRIC}, namespace)"),
        _query_variable(
            "model", "Model", f'label_values({VARIABLE_METRIC}{{namespace=~"$namespace"}}, model)'
        ),
        _query_variable(
            "worker",
            "Worker",
            f'label_values({VARIABLE_METRIC}{{namespace=~"$namespace", model=~"$model"}}, worker)',
        ),
    ]
