"""A gate run's report: ``<out>/gpu-gate-<date>-<arm>.json`` (every case's record: its
settings, the engines' results without the per-block hashes, the verdict) and ``.md`` (the
table below), both rewritten after every case."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybridfa_gate.judge import verdict
from hybridfa_gate.models import atomic_write

TABLE_COLUMNS = ("arm", "case", "vLLM", "model", "N/page/ratio", "layout", "KV dtype")
TABLE_COLUMNS += ("CUDA graphs (resolved)", "chunk")
TABLE_COLUMNS += ("prompt tokens", "hit %", "restore TTFT s (warm, median / first in engine)")
TABLE_COLUMNS += ("cold TTFT s (restore engine, median / cold engine)", "bytes match")
TABLE_COLUMNS += ("tokens match", "logprobs match", "pass")


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def md_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(map(fmt, row)) + " |" for row in rows]


def write_json_md(stem: Path | str, report: dict[str, Any], markdown: str) -> None:
    atomic_write(Path(f"{stem}.json"), json.dumps(report, indent=1, default=str) + "\n")
    atomic_write(Path(f"{stem}.md"), markdown)


def resolved_graphs(rec: dict[str, Any]) -> str:
    """The CUDA-graph modes a case's engines ran with, one if they agree ("-": none reported)."""
    modes = dict.fromkeys(m for m in (rec.get("cudagraph_mode") or {}).values() if m)
    return "/".join(modes) or "-"


def model_runners(report: dict[str, Any]) -> str:
    """The vLLM model runners the run's engines ran on (``worker.runner_name``), "" where
    none reported one."""
    engines = [e for rec in report["cases"] for e in (rec.get("engines") or {}).values() if e]
    return ", ".join(dict.fromkeys(e["model_runner"] for e in engines if e.get("model_runner")))


def table_row(arm: str, rec: dict[str, Any]) -> list[str]:
    ev = rec.get("eval", {})
    g = rec["geometry"]
    lp = ev.get("logprobs_match")
    lp_s = None if lp is None else f"{fmt(lp)} ({fmt(ev.get('logprob_max_diff'))})"
    restore = " / ".join(fmt(ev.get(k)) for k in ("restore_s", "first_restore_s") if ev.get(k))
    cold = " / ".join(fmt(ev.get(k)) for k in ("cold_same_engine_s", "cold_s") if ev.get(k))
    row = [arm, rec["case"], fmt(rec.get("vllm")), rec["model"]]
    row += [f"{g['block_size']}/{g['kernel_page']}/{g['ratio']}", rec["layout"]]
    row += [rec.get("kv_cache_dtype") or "auto", resolved_graphs(rec)]
    row += [str(rec["chunk"]), str(rec["prompt_tokens"])]
    row += [fmt(ev.get("hit_pct"))]
    # a restore that is meant to miss has no restored bytes to compare
    bytes_match = "-" if ev.get("mode") in ("refused", "miss") or ev.get("refused") else None
    row += [restore or "-", cold or "-", bytes_match or fmt(ev.get("bytes_match"))]
    row += [fmt(ev.get("tokens_match"))]
    if not ev.get("completed"):
        result = "ERROR"
    elif ev.get("pass"):
        result = verdict(ev) if verdict(ev) != "pass" else fmt(True)
    else:
        result = verdict(ev)
    return row + [fmt(lp_s), result]


def markdown_report(report: dict[str, Any]) -> str:
    lines = [
        f"# GPU restart gate, arm {report['arm']} ({report['date']})",
        "",
        f"- hardware: {report.get('hardware')}",
        f"- versions: {report.get('versions')}",
        f"- model runner: {model_runners(report) or '-'}",
        f"- extra server args: {report.get('server_args') or 'none'}",
        f"- cases run: {len(report['cases'])}",
        "",
        *md_table(TABLE_COLUMNS, (table_row(report["arm"], rec) for rec in report["cases"])),
    ]
    errs = [(r["case"], r.get("eval", {}).get("errors")) for r in report["cases"]]
    errs = [f"- {c}: {'; '.join(e)[:600]}" for c, e in errs if e]
    return "\n".join(lines + (["", "## Errors", "", *errs] if errs else [])) + "\n"


def write_report(report: dict[str, Any], stem: Path) -> None:
    evs = [r["eval"] for r in report["cases"]]
    report["summary"] = {"run": len(evs), "passed": sum(bool(ev.get("pass")) for ev in evs)}
    report["summary"]["bytes_mismatch"] = sum(ev.get("bytes_match") is False for ev in evs)
    report["summary"]["errors"] = sum(not ev.get("completed") for ev in evs)
    write_json_md(stem, report, markdown_report(report))
