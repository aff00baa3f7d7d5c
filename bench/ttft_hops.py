"""Where TTFT went, hop by hop, from a local stack's spans (``--stack ...:traces=1``: each
process appends its spans to ``RUN_DIR/traces/NAME.jsonl``).

For each request whose gateway span marks its first token, the milliseconds from the gateway's
arrival to each later mark of its trace: its prompt templated, tokenized and checked, the
router's Route call starting and sending its first message, the prefill worker's call starting
and ending, the decode worker's Generate call starting and sending its first message, and the
gateway's first token. A run's marks are the
means over its requests (`HOPS`), so consecutive marks show what each hop added: a decode
worker's call that starts late is placement or the gateway's call to it; one whose first
message is late is its engine (compare the engine's own TTFT); a first token long after that
message is the way back.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from services.gateway.observe import FIRST_TOKEN
from services.gateway.routes.generate import PREPARED
from services.observability.grpc import FIRST_RESPONSE

ROUTE, PREFILL = "tandem.v1.Router/Route", "tandem.v1.Prefill/Prefill"
GENERATE = "tandem.v1.Decode/Generate"

# label -> (span name, "start" | "end" | an event's name): a mark on a request's trace.
HOPS: dict[str, tuple[str, str]] = {
    "prepared": ("", PREPARED),  # "": the gateway's request span
    "at route": (ROUTE, "start"),
    "route's first": (ROUTE, FIRST_RESPONSE),
    "at prefill": (PREFILL, "start"),
    "prefill done": (PREFILL, "end"),
    "at generate": (GENERATE, "start"),
    "generate's first": (GENERATE, FIRST_RESPONSE),
    "first token": ("", FIRST_TOKEN),
}


def offsets(run_dir: Path) -> dict[Path, int]:
    """How far each trace file of ``run_dir`` reaches now (read after a run: `new_spans`)."""
    return {p: p.stat().st_size for p in sorted((run_dir / "traces").glob("*.jsonl"))}


def new_spans(run_dir: Path, since: Mapping[Path, int]) -> list[dict]:
    """The spans appended to ``run_dir``'s trace files after ``since`` (`offsets`)."""
    spans = []
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        with path.open("rb") as f:
            f.seek(since.get(path, 0))
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written now is left for later
        spans += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return spans


def _mark(span: dict, what: str) -> int | None:
    if what == "start":
        return span["start_ns"]
    if what == "end":
        return span["end_ns"]
    return span.get("events", {}).get(what)


def hops(spans: Iterable[dict]) -> dict[str, float]:
    """Mean milliseconds from the gateway's arrival to each of `HOPS` (a mark no request had is
    left out), and ``requests``: how many requests the means are over."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    requests = 0
    for trace in by_trace.values():
        ids = {s["span_id"] for s in trace}
        roots = [
            s for s in trace if s["parent_id"] not in ids and FIRST_TOKEN in s.get("events", {})
        ]
        if len(roots) != 1:  # not a generation that streamed a token (or a trace cut short)
            continue
        root, requests = roots[0], requests + 1
        for label, (name, what) in HOPS.items():
            named = [root] if not name else [s for s in trace if s["name"] == name]
            marks = [t for s in named if (t := _mark(s, what)) is not None]
            if marks:  # the first (a retried or migrated request has several calls)
                sums[label] += (min(marks) - root["start_ns"]) / 1e6
                counts[label] += 1
    out = {label: sums[label] / counts[label] for label in HOPS if counts[label]}
    return {**out, "requests": float(requests)} if requests else {}


def render(rows: Sequence[tuple[str, str, str, Mapping[str, float]]]) -> str:
    """Markdown table of `hops` per (endpoint, workload, rate): the marks some row has."""
    shown = [h for h in HOPS if any(h in marks for *_, marks in rows)]
    lines = [
        "| endpoint | workload | rate | requests | " + " | ".join(f"{h} ms" for h in shown) + " |",
        "|---|---|---|---:|" + "---:|" * len(shown),
    ]
    for endpoint, workload, rate, marks in rows:
        cells = [f"{marks[h]:.1f}" if h in marks else "-" for h in shown]
        n = int(marks.get("requests", 0))
        lines.append(f"| {endpoint} | {workload} | {rate} | {n} | {' | '.join(cells)} |")
    return "\n".join(lines)
