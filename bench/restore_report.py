"""The restore bench's results: the LMCache server log it reads each restore's L2 objects from,
the merge of the pieces, each restore against its floor, the report (JSON, markdown, plots)."""

from __future__ import annotations

import datetime as _dt
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.floor import GB, floor_s, spread
from hybridfa_gate.report import fmt, md_table, write_json_md

SCHEMA = "hybridfa-bench-gpu/3"
MAIN_MODEL = "qwen35-9b"  # drawn with solid lines
ARMS = ("cold", "default", "pagecache", "offloading", "lmcache056")


def offloading_transfer_config(root: Path, cpu_bytes: int, engine_id: str) -> dict[str, Any]:
    """vLLM 0.26.0's OffloadingConnector: a CPU tier and a file-system tier under ``root``.
    ``engine_id`` names its /dev/shm region, which an engine that is killed leaves behind."""
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": int(cpu_bytes),
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }


_TS = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]"
_PREFETCH = re.compile(
    _TS + r"[^\n]*?Prefetch request completed[^:\n]*: \d+/\d+ retained keys \((\d+) L1, (\d+) L2\)"
)


def parse_server_log(text: str) -> dict[str, list[dict[str, Any]]]:
    """prefetch: each ``Prefetch request completed`` line's L1 / L2 objects, at its epoch."""

    def epoch(day: str, ms: str) -> float:
        return time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3

    found = _PREFETCH.findall(text)
    return {"prefetch": [{"t": epoch(d, ms), "l1": int(a), "l2": int(b)} for d, ms, a, b in found]}


def l2_read_bytes(l2: int, hit: int, chunk: int, group_means: dict[str, float], fa: int) -> Any:
    """Bytes of ``l2`` objects a restore read: one object group, all at its size; several (FA
    apart from recurrent state), FA's (size nearest ``fa``) per hit chunk, the rest the others'."""
    if not l2 or not group_means:
        return None
    if len(group_means) == 1:
        return l2 * next(iter(group_means.values()))
    fa_group = min(group_means, key=lambda g: abs(group_means[g] - fa))
    others = [v for g, v in group_means.items() if g != fa_group]
    n_fa = min(hit // chunk, l2)
    return n_fa * group_means[fa_group] + (l2 - n_fa) * sum(others) / len(others)


def object_group_means(inventory: dict[str, Any]) -> dict[str, float]:
    """Mean object bytes per object group of an L2 inventory (``l2.tier_inventory``)."""
    groups = inventory.get("per_object_group") or {}
    return {og: g["bytes"] / g["objects"] for og, g in groups.items() if g.get("objects")}


def sort_key(r: dict[str, Any]) -> tuple[str, int, int, str]:
    return r["model"], r["prompt_tokens"], ARMS.index(r["arm"]), r["mode"]


def merge_pieces(pieces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from pieces (bench.gpu_restore piece files). A piece run again (same
    name) replaces the earlier run; pieces of one row with other names (``--part``) add their
    restores and colds up. Each restore keeps its piece's read ceiling."""
    res: dict[str, Any] = {"schema": SCHEMA, "created": _dt.date.today().isoformat()}
    res.update(runs=[], rows={})
    latest = {x["piece"]: x for x in sorted(pieces, key=lambda x: str(x["run"].get("started")))}
    for piece in sorted(latest.values(), key=lambda x: str(x["run"].get("started"))):
        run = {"piece": piece["piece"], **piece["run"]}
        res["runs"].append(run)
        for key, row in piece["rows"].items():
            restores = [{**x, "ceiling": run.get("ceiling")} for x in row.get("restores") or []]
            new = {**row, "pieces": [piece["piece"]], "restores": restores}
            if old := res["rows"].get(key):
                for k in ("pieces", "restores", "colds_in_engine", "errors", "findings"):
                    new[k] = old.get(k, []) + new.get(k, [])
            res["rows"][key] = new
    summarize(res)
    return res


def summarize(results: dict[str, Any]) -> None:
    """Per row: spreads of the proven, correct restores and of the colds, the fixed cost, each
    restore's floor; the speedups against the colds of the same engine and of the cold arm."""
    rows = results["rows"]
    for r in rows.values():
        which = "page_cache_gbps" if r["arm"] == "pagecache" else "disk_gbps"
        good = [x for x in r.get("restores") or [] if x.get("proven") and x.get("correct")]
        r["fixed_s"] = spread(x.get("fixed_s") for x in r.get("restores") or [])["median"]
        for x in r.get("restores") or []:
            x["floor_bytes"] = (
                x.get("object_bytes") if r["arm"] == "pagecache" else x.get("io_read_bytes")
            )
            x["floor_s"] = floor_s(
                x["floor_bytes"], (x.get("ceiling") or {}).get(which), r["fixed_s"]
            )
            ttft = x.get("ttft_s")
            x["floor_over_restore"] = x["floor_s"] / ttft if x["floor_s"] and ttft else None
        r["restore_ttft"] = spread(x["ttft_s"] for x in good)
        r["floor_over_restore"] = spread(x["floor_over_restore"] for x in good)
        r["read_bytes"] = spread(x.get("floor_bytes") for x in good)["median"]
        r["restores_counted"] = f"{len(good)} of {len(r.get('restores') or [])}"
        r["cold_ttft"] = spread(r.get("colds_in_engine") or [])
        cold = rows.get(f"{r['model']}:{r['prompt_tokens']}:cold:{r['mode']}") or {}
        no_conn = spread(cold.get("colds_in_engine") or [])["median"]
        med = r["restore_ttft"]["median"]
        r["speedup"] = r["cold_ttft"]["median"] / med if med and r["cold_ttft"]["median"] else None
        r["speedup_vs_no_connector"] = no_conn / med if med and no_conn else None
    results["findings"] = [f for r in sorted(rows.values(), key=sort_key) for f in r["findings"]]


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**missed**")


def targets(results: dict[str, Any]) -> list[str]:
    """bench/README.md's targets, evaluated on the CUDA-graph rows of the main model."""
    rows = {
        (r["prompt_tokens"], r["arm"]): r
        for r in results["rows"].values()
        if r["model"] == MAIN_MODEL and r["mode"] == "graphs"
    }

    def med(p: int, arm: str) -> float | None:
        return (rows.get((p, arm)) or {}).get("restore_ttft", {}).get("median")

    def exact(p: int, arm: str) -> bool:
        r = rows.get((p, arm)) or {}
        return bool(r.get("restores")) and all(x.get("correct") for x in r["restores"])

    out = []
    for p in (26624, 65536, 131072):
        f = ((rows.get((p, "default")) or {}).get("floor_over_restore") or {}).get("median")
        out.append(
            f"- disk restore >= 0.9 of its floor at {p}: "
            f"{_verdict(None if f is None else f >= 0.9)} ({fmt(f)})"
        )
    for p in sorted({p for p, _ in rows}):
        ours = med(p, "default") if exact(p, "default") else None
        for peer in ("offloading", "lmcache056"):
            theirs = med(p, peer)
            ok = None if ours is None or theirs is None else ours < theirs
            out.append(
                f"- faster than {peer} at {p} (exact KV): {_verdict(ok)} "
                f"({fmt(ours)} s vs {fmt(theirs)} s)"
            )
    for p, arm, x in ((26624, "pagecache", 15), (131072, "default", 6)):
        s = (rows.get((p, arm)) or {}).get("speedup")
        out.append(
            f"- {arm} >= {x}x the cold at {p}: "
            f"{_verdict(None if s is None else s >= x)} ({fmt(s)}x)"
        )
    return out


HEADER = (
    "model | prompt | arm | mode | hit | cold median (min-max) | restore median (min-max)"
    " | counted | speedup | vs no-connector cold | GB read | fixed s | floor/restore median (min)"
    " | KV exact | errors"
)


def _sp(s: dict[str, Any] | None) -> str:
    s = s or {}
    return f"{fmt(s.get('median'))} ({fmt(s.get('min'))}-{fmt(s.get('max'))})"


def markdown_report(results: dict[str, Any]) -> str:
    runs = results.get("runs") or [{}]
    lines = [f"# GPU restore bench ({results.get('created')})", ""]
    for run in runs:
        c = run.get("ceiling") or {}
        lines.append(
            f"- {run.get('piece')} ({run.get('started')}): disk ceiling {fmt(c.get('disk_gbps'))}"
            f" GB/s, page cache {fmt(c.get('page_cache_gbps'))} GB/s, disk plan "
            f"{run.get('disk_plan')}"
        )
    lines += [f"- hardware: {runs[-1].get('hardware')}", f"- versions: {runs[-1].get('versions')}"]
    lines += ["", "TTFT s. Floor = bytes read / read ceiling + the engine's fixed cost after the"]
    lines += ["hit; counted: restores whose source is proven and whose KV bytes are exact.", ""]
    table = []
    for r in sorted(results["rows"].values(), key=sort_key):
        hits = {x.get("hit_tokens") for x in r.get("restores") or []}
        ratio = r.get("floor_over_restore") or {}
        table.append(
            [
                r["model"],
                r["prompt_tokens"],
                r["arm"],
                r["mode"],
                ",".join(map(str, sorted(h for h in hits if h is not None))) or None,
                _sp(r.get("cold_ttft")),
                _sp(r.get("restore_ttft")),
                r.get("restores_counted"),
                r.get("speedup"),
                r.get("speedup_vs_no_connector"),
                r["read_bytes"] / GB if r.get("read_bytes") else None,
                r.get("fixed_s"),
                f"{fmt(ratio.get('median'))} ({fmt(ratio.get('min'))})",
                all(x.get("kv_match") for x in r["restores"]) if r.get("restores") else None,
                "; ".join(r.get("errors") or [])[:200],
            ]
        )
    lines += md_table(HEADER.split(" | "), table)
    lines += ["", "## Targets (bench/README.md)", "", *targets(results)]
    found = [
        f"- {f['model']} {f['prompt_tokens']} {f['arm']} {f['mode']}: {f['what'][:600]}"
        for f in results.get("findings") or []
    ]
    return "\n".join(lines + ["", "## Findings", "", *(found or ["- none"])]) + "\n"


def write_results(results: dict[str, Any], path: Path) -> None:
    """<stem>.json, <stem>.md and, where matplotlib imports, <stem>-ttft.png, -floor.png."""
    path.parent.mkdir(parents=True, exist_ok=True)
    results["plots"] = write_plots(results, path)
    write_json_md(path.with_suffix(""), results, markdown_report(results))


def write_plots(results: dict[str, Any], path: Path) -> str:
    """TTFT per arm and mode against prompt length; each counted restore against its floor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib does not import"
    rows = sorted(results["rows"].values(), key=sort_key)
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        k = r["prompt_tokens"] / 1024
        if r["arm"] == "cold" and (c := r["cold_ttft"]["median"]):
            series.setdefault(f"{r['model']} cold (no connector) {r['mode']}", []).append((k, c))
        elif (t := r["restore_ttft"]["median"]) is not None:
            series.setdefault(f"{r['model']} {r['arm']} {r['mode']}", []).append((k, t))
            if r["arm"] == "default" and (c := r["cold_ttft"]["median"]):
                series.setdefault(f"{r['model']} cold in engine {r['mode']}", []).append((k, c))
    for label, pts in sorted(series.items()):
        style = "o-" if label.startswith(MAIN_MODEL) and "graphs" in label else "s:"
        ax.plot(*zip(*sorted(pts), strict=True), style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="prompt (k tokens)", ylabel="TTFT median (s)")
    ax.legend(fontsize=7)
    fig.savefig(path.with_name(f"{path.stem}-ttft.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
    pts = [
        (f"{r['arm']} {r['mode']}\n{r['prompt_tokens'] // 1024}k", x)
        for r in rows
        for x in r.get("restores") or []
        if x.get("floor_s") and x.get("proven") and x.get("correct")
    ]
    if not pts:
        return "ttft only: no restore with a floor"
    labels = list(dict.fromkeys(label for label, _ in pts))
    fig, ax = plt.subplots(figsize=(max(6, len(labels)), 4.5))
    for label, x in pts:
        i = labels.index(label)
        ax.plot(i - 0.1, x["ttft_s"], "o", color="C1")
        ax.plot(i + 0.1, x["floor_s"], "_", color="C0", markersize=14)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set(ylabel="s", yscale="log", title="each restore (dots) against its floor (bars)")
    fig.savefig(path.with_name(f"{path.stem}-floor.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
    return "written"
