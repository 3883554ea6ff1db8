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

The JSON files are strict JSON: a NaN or infinite number is written as ``null``.  The
text of ``junit.xml`` and ``report.html`` (names, reasons, stderr tails) drops ANSI
terminal escapes and has every other character XML 1.0 forbids replaced by U+FFFD.  The
directory is replaced as a whole: the files are written into a staging directory inside
it and moved into place once all of them are (:class:`adcloud._commit.JobOutput`), so a
report that fails midway leaves the earlier one whole.

Format history: version 1 -- first version.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import math
import posixpath
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from xml.etree import ElementTree as ET

from adcloud._commit import JobOutput
from adcloud.sim.errors import SimError
from adcloud.sim.replay import ReplayResults, ScenarioResult, _finite_json
from adcloud.store import Store, StoreError, locate
from adcloud.store.filesystem import StoreFileSystem

__all__ = ["REPORT_VERSION", "check_report_target", "junit_xml", "read_results", "write_report"]

REPORT_VERSION = 1

#: The files of a report, in the order they are written (``job.json`` last: see
#: :meth:`JobOutput.commit`).
_FILES = ("results.jsonl", "junit.xml", "latency.png", "report.html", "job.json")

#: The most scenarios ``latency.png`` names one by one (beyond, they are numbered).
_MAX_NAMED = 80
#: ANSI terminal escapes (colours, cursor moves) that nodes write to stderr.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
#: Characters XML 1.0 forbids: C0 controls but tab, LF and CR; surrogates; U+FFFE, U+FFFF.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _store_url(uri: str) -> str:
    return uri if "://" in uri else "file://" + str(Path(uri).resolve())


def _markup_text(text: str) -> str:
    """``text`` as XML 1.0 (and HTML) can hold it: ANSI escapes dropped, any other
    forbidden character replaced by U+FFFD (a node's stderr may hold anything)."""
    return _NOT_XML.sub("\ufffd", _ANSI.sub("", text))


def junit_xml(results: Sequence[ScenarioResult], suite: str = "adcloud.sim") -> bytes:
    """The results as a JUnit XML document (one test case per scenario); always
    well-formed (see :func:`_markup_text`)."""
    failures = sum(not r.passed for r in results)
    suite = _markup_text(suite)
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
            root,
            "testcase",
            classname=suite,
            name=_markup_text(r.scenario),
            time=f"{r.wall_s:.3f}",
        )
        props = ET.SubElement(case, "properties")
        for key, value in sorted(r.metrics.items()):
            ET.SubElement(props, "property", name=_markup_text(key), value=f"{value:g}")
        reason, stderr = _markup_text(r.reason), _markup_text(r.stderr_tail)
        if not r.passed:
            fail = ET.SubElement(case, "failure", message=reason[:500], type="ScenarioFailed")
            fail.text = f"{reason}\nexit code: {r.exit_code}\n{stderr}"
        if stderr:
            ET.SubElement(case, "system-err").text = stderr
    return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))


def _plot(results: Sequence[ScenarioResult]) -> bytes:
    import matplotlib  # noqa: PLC0415 - heavy; only reports need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r.scenario for r in results]
    x = range(len(results))
    # a named tick per scenario up to _MAX_NAMED, then a plot of that width: one as wide
    # as thousands of windows took minutes and gigabytes, and failed the whole report
    named = len(results) <= _MAX_NAMED
    width = 0.4 * min(len(results), _MAX_NAMED) + 3
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6.0, width), 6))
    for key, label in (
        ("latency_p50_ms", "p50"),
        ("latency_p95_ms", "p95"),
        ("latency_max_ms", "max"),
    ):
        ax1.plot(x, [getattr(r, key) for r in results], marker="o", label=label)
    ax1.set_ylabel("latency (ms)")
    # parse_math=False: scenario names are plain text ("cost $5" is no formula)
    ticks = {"rotation": 60, "ha": "right", "fontsize": 7, "parse_math": False}
    if named:
        ax1.set_xticks(list(x), names, **ticks)
    ax1.legend()
    ax1.set_title("Per-message latency by scenario")
    colors = ["tab:green" if r.passed else "tab:red" for r in results]
    ax2.bar(x, [r.wall_s for r in results], color=colors)
    ax2.set_ylabel("wall time (s)")
    ax2.set_title("Wall time (green: pass, red: fail)")
    if named:
        ax2.set_xticks(list(x), names, **ticks)
    else:
        ax2.set_xlabel(f"scenario (0 to {len(results) - 1}, in the order of results.jsonl)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _fmt(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.1f}"


def _html_text(text: str) -> str:
    return html.escape(_markup_text(text))


def _html(results: ReplayResults) -> bytes:
    rs = results.results
    passed = sum(r.passed for r in rs)
    rows = []
    for r in rs:
        status = "PASS" if r.passed else "FAIL"
        metrics = ", ".join(f"{k}={v:.3g}" for k, v in sorted(r.metrics.items()))
        outputs = ", ".join(f"{k}: {v}" for k, v in sorted(r.output_counts.items()))
        rows.append(
            f"<tr class='{status.lower()}'><td>{_html_text(r.scenario)}</td><td>{status}</td>"
            f"<td>{_html_text(r.reason)}</td><td>{r.input_count}</td>"
            f"<td>{_html_text(outputs)}</td><td>{_fmt(r.latency_p50_ms)}</td>"
            f"<td>{_fmt(r.latency_p95_ms)}</td><td>{_fmt(r.latency_max_ms)}</td>"
            f"<td>{r.wall_s:.2f}</td><td>{r.exit_code if r.exit_code is not None else ''}</td>"
            f"<td>{_html_text(metrics)}</td></tr>"
        )
    node = _html_text(" ".join(results.job.node.args))
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>adcloud replay report</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}
tr.pass td:nth-child(2){{color:#080}} tr.fail td:nth-child(2){{color:#c00;font-weight:bold}}</style>
</head><body>
<h1>Replay report: {passed} of {len(rs)} scenarios passed</h1>
<p>node ({_html_text(results.job.node.adapter)}): <code>{node}</code>;
wall time {results.wall_s:.1f} s</p>
<img src="latency.png" alt="latency and wall time per scenario">
<table><tr><th>scenario</th><th>result</th><th>reason</th><th>inputs</th><th>outputs</th>
<th>p50 ms</th><th>p95 ms</th><th>max ms</th><th>wall s</th><th>exit</th><th>metrics</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
    return page.encode("utf-8")


def _results_jsonl(results: Sequence[ScenarioResult]) -> bytes:
    lines = (json.dumps(r.to_dict(), sort_keys=True, allow_nan=False) + "\n" for r in results)
    return "".join(lines).encode("utf-8")


def _job_json(results: ReplayResults) -> bytes:
    job = {"report_version": REPORT_VERSION, "job": results.job.to_dict(), "wall_s": results.wall_s}
    text = json.dumps(_finite_json(job), indent=2, default=str, allow_nan=False)
    return (text + "\n").encode("utf-8")


def _store_output(url: str, ours: Callable[[str], bool], what: str) -> tuple[Store, JobOutput]:
    """The report directory ``url`` (any store URI or fsspec URL) as a :class:`JobOutput`
    replacing the entries ``ours`` recognises."""
    store, root = locate(url)
    output = JobOutput(
        StoreFileSystem.over(store), root, url, overwrite=True, ours=ours, error=SimError, what=what
    )
    return store, output


def _report_output(url: str) -> tuple[Store, JobOutput]:
    return _store_output(url, lambda name: name in _FILES, "a replay report")


def _put_report(store: Store, where: str, results: ReplayResults) -> None:
    """Write the report files into the store directory ``where`` (a staging directory;
    ``put`` makes it)."""
    render: dict[str, Callable[[], bytes]] = {
        "results.jsonl": lambda: _results_jsonl(results.results),
        "junit.xml": lambda: junit_xml(results.results),
        "latency.png": lambda: _plot(results.results),
        "report.html": lambda: _html(results),
        "job.json": lambda: _job_json(results),
    }
    for name in _FILES:
        store.put(posixpath.join(where, name), render[name]())


def check_report_target(uri: str) -> None:
    """Raise :class:`SimError` now if :func:`write_report` would refuse ``uri`` (a file, or
    a directory holding other files), before a replay job runs for it."""
    _report_output(_store_url(uri))


def write_report(results: ReplayResults, uri: str) -> str:
    """Write the report files into the directory ``uri`` (any store URI); return its URL.

    Replaces an earlier report there as a whole, and only once every file is written: a
    failure leaves the earlier report (or no directory) as it was.  Raises
    :class:`SimError` for a file, or a directory holding files a report does not write.
    """
    url = _store_url(uri)
    store, output = _report_output(url)
    output.start()
    try:
        _put_report(store, output.staging, results)
    except BaseException:
        with contextlib.suppress(StoreError):  # the failure that matters is the one raised
            output.abort()
        raise
    output.commit([(posixpath.join(output.staging, n), n) for n in _FILES], first=("job.json",))
    return url


def read_results(uri: str) -> list[ScenarioResult]:
    """The results of a report directory written by :func:`write_report`.

    Raises :class:`SimError` naming the file and line of one that is not a result (a
    truncated or hand-edited ``results.jsonl``).
    """
    url = _store_url(uri)
    store, root = locate(url)
    data = store.get(root.rstrip("/") + "/results.jsonl")
    out = []
    # line by line, bytes: a file cut inside a multi-byte character fails at its line
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            out.append(ScenarioResult.from_dict(json.loads(line.decode("utf-8"))))
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise SimError(
                f"{url.rstrip('/')}/results.jsonl line {number} is not a scenario result "
                f"({type(err).__name__}: {err})"
            ) from err
    return out
