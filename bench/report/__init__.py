"""Results of a ``tandem bench`` run: the table, the compare ratios, JSON with every request,
a markdown page, and PNG plots (matplotlib, Agg backend).

One module per output: ``tables`` (markdown tables), ``markdown`` (``results.md``),
``results_json`` (``results.json``), ``plots`` (PNG), ``machine`` (what the run ran on), and
``run`` (``RunReport``, what they all read). The names below are the package's face: import
them from ``bench.report``."""

from bench.report.machine import cpu_model, machine_info
from bench.report.markdown import TRACE_INTRO, write_markdown
from bench.report.plots import write_plots
from bench.report.results_json import to_json, write_json
from bench.report.run import RunReport, rate_label
from bench.report.tables import (
    TABLE_HEAD,
    render_ratios,
    render_resources,
    render_table,
    render_traces,
)

__all__ = [
    "TABLE_HEAD",
    "TRACE_INTRO",
    "RunReport",
    "cpu_model",
    "machine_info",
    "rate_label",
    "render_ratios",
    "render_resources",
    "render_table",
    "render_traces",
    "to_json",
    "write_json",
    "write_markdown",
    "write_plots",
]
