"""Replay reports on any store URI: ``results.jsonl``, JUnit XML and an HTML summary.

:func:`write_report` writes into a directory named by a store URI (``local://...``,
``file:///...``, ``s3://...``, ``alluxio://...``; a plain path means ``file://``):

- ``results.jsonl`` -- one JSON object per scenario (:meth:`ScenarioResult.to_dict`)
  and nothing else; its format version is ``report_version`` in ``job.json``;
- ``junit.xml`` -- one ``<testcase>`` per scenario, ``<failure>`` with the reason and
  the stderr tail for failed ones (CI systems read it);
- ``report.html`` -- a pass/fail table and ``latency.png`` (per-scenario latency
  p50/p95/max and wall time, matplotlib);
- ``job.json`` -- ``report_version`` (:data:`REPORT_VERSION`), the effective job
  settings (``job``) and the job's wall time (``wall_s``).

Format history: version 1 -- first version.
"""

from __future__ import annotations

import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree as ET

from adcloud.sim.replay import ReplayResults, ScenarioResult
from adcloud.store import locate

__all__ = ["REPORT_VERSION", "junit_xml", "read_results", "write_report"]

REPORT_VERSION = 1


def _store_url(uri: str) -> str:
    return uri if "://" in uri else "file://" + str(Path(uri).resolve())


def junit_xml(results: Sequence[ScenarioResult], suite: str = "adcloud.sim") -> bytes:
    """The results as a JUnit XML document (one test case per scenario)."""
    failures = sum(not r.passed for r in results)
    root = ET.Element(
        "testsuite",
        name=suite,
        tests=str(len(results)),
        failures=str(failures),
        errors="0",
        time=f"{sum(r.wall_s for r in results):.3f}",
    )
    for r in results:
        case = ET.SubElement(
            root, "testcase", classname=suite, name=r.scenario, time=f"{r.wall_s:.3f}"
        )
        props = ET.SubElement(case, "properties")
        for key, value in sorted(r.metrics.items()):
            ET.SubElement(props, "property", name=key, value=f"{value:g}")
        if not r.passed:
            fail = ET.SubElement(case, "failure", message=r.reason[:500], type="ScenarioFailed")
            fail.text = f"{r.reason}\nexit code: {r.exit_code}\n{r.stderr_tail}"
        if r.stderr_tail:
            ET.SubElement(case, "system-err").text = r.stderr_tail
    return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))


def _plot(results: Sequence[ScenarioResult]) -> bytes:
    import matplotlib  # noqa: PLC0415 - heavy; only reports need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r.scenario for r in results]
    x = range(len(results))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6.0, 0.4 * len(results) + 3), 6))
    for key, label in (
        ("latency_p50_ms", "p50"),
        ("latency_p95_ms", "p95"),
        ("latency_max_ms", "max"),
    ):
        ax1.plot(x, [getattr(r, key) for r in results], marker="o", label=label)
    ax1.set_ylabel("latency (ms)")
    ax1.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    ax1.legend()
    ax1.set_title("Per-message latency by scenario")
    colors = ["tab:green" if r.passed else "tab:red" for r in results]
    ax2.bar(x, [r.wall_s for r in results], color=colors)
    ax2.set_ylabel("wall time (s)")
    ax2.set_title("Wall time (green: pass, red: fail)")
    ax2.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _fmt(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.1f}"


def _html(results: ReplayResults) -> bytes:
    rs = results.results
    passed = sum(r.passed for r in rs)
    rows = []
    for r in rs:
        status = "PASS" if r.passed else "FAIL"
        metrics = ", ".join(f"{k}={v:.3g}" for k, v in sorted(r.metrics.items()))
        outputs = ", ".join(f"{k}: {v}" for k, v in sorted(r.output_counts.items()))
        rows.append(
            f"<tr class='{status.lower()}'><td>{html.escape(r.scenario)}</td><td>{status}</td>"
            f"<td>{html.escape(r.reason)}</td><td>{r.input_count}</td>"
            f"<td>{html.escape(outputs)}</td><td>{_fmt(r.latency_p50_ms)}</td>"
            f"<td>{_fmt(r.latency_p95_ms)}</td><td>{_fmt(r.latency_max_ms)}</td>"
            f"<td>{r.wall_s:.2f}</td><td>{r.exit_code if r.exit_code is not None else ''}</td>"
            f"<td>{html.escape(metrics)}</td></tr>"
        )
    node = html.escape(" ".join(results.job.node.args))
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>adcloud replay report</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}
tr.pass td:nth-child(2){{color:#080}} tr.fail td:nth-child(2){{color:#c00;font-weight:bold}}</style>
</head><body>
<h1>Replay report: {passed} of {len(rs)} scenarios passed</h1>
<p>node ({html.escape(results.job.node.adapter)}): <code>{node}</code>;
wall time {results.wall_s:.1f} s</p>
<img src="latency.png" alt="latency and wall time per scenario">
<table><tr><th>scenario</th><th>result</th><th>reason</th><th>inputs</th><th>outputs</th>
<th>p50 ms</th><th>p95 ms</th><th>max ms</th><th>wall s</th><th>exit</th><th>metrics</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
    return page.encode("utf-8")


def write_report(results: ReplayResults, uri: str) -> str:
    """Write the report files into the directory ``uri`` (any store URI); return its URL."""
    url = _store_url(uri)
    store, root = locate(url)
    base = root.rstrip("/")
    lines = "".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in results.results)
    job = {"report_version": REPORT_VERSION, "job": results.job.to_dict(), "wall_s": results.wall_s}
    store.put(f"{base}/results.jsonl", lines.encode("utf-8"))
    store.put(f"{base}/junit.xml", junit_xml(results.results))
    store.put(f"{base}/latency.png", _plot(results.results))
    store.put(f"{base}/report.html", _html(results))
    store.put(f"{base}/job.json", (json.dumps(job, indent=2, default=str) + "\n").encode("utf-8"))
    return url


def read_results(uri: str) -> list[ScenarioResult]:
    """The results of a report directory written by :func:`write_report`."""
    store, root = locate(_store_url(uri))
    text = store.get(root.rstrip("/") + "/results.jsonl").decode("utf-8")
    return [ScenarioResult.from_dict(json.loads(line)) for line in text.splitlines() if line]
