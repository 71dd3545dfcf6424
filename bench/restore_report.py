"""The restore bench's results: the LMCache server log it reads each restore's objects and each
cold's stores from, the merge of the pieces (one report per revision, software set and GPU
model), each restore against its floor, the cost of a miss, the report (JSON, markdown, plots)."""

from __future__ import annotations

import datetime as _dt
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.floor import GB, floor_s, spread
from bench.machine import first_gpu, identity_key
from hybridfa_gate.report import fmt, md_table, write_json_md

SCHEMA = "hybridfa-bench-gpu/4"
MAIN_MODEL = "qwen35-9b"  # drawn with solid lines
ARMS = ("cold", "default", "pagecache", "offloading", "lmcache056")
FLOOR_TARGET, MISS_TARGET = 0.9, 1.10


class MergeError(ValueError):
    """Pieces that must not share a report."""


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
_STORED = re.compile(_TS + r"[^\n]*?Stored (\d+) tokens in ([\d.]+) seconds")


def _epoch(day: str, ms: str) -> float:
    return time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3


def parse_server_log(text: str) -> dict[str, list[dict[str, Any]]]:
    """prefetch: each ``Prefetch request completed`` line's L1 / L2 objects; stores: each
    ``Stored N tokens in S seconds`` line (a store's copies out of the GPU); at their epochs."""
    prefetch = [
        {"t": _epoch(d, ms), "l1": int(a), "l2": int(b)} for d, ms, a, b in _PREFETCH.findall(text)
    ]
    stores = [
        {"t": _epoch(d, ms), "tokens": int(n), "s": float(s)}
        for d, ms, n, s in _STORED.findall(text)
    ]
    return {"prefetch": prefetch, "stores": stores}


def l2_read_bytes(l2: int, hit: int, chunk: int, group_means: dict[str, float], fa: int) -> Any:
    """Bytes of ``l2`` objects: one object group, all at its size; several (FA apart from
    recurrent state), FA's (size nearest ``fa``) per hit chunk, the rest the others'."""
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


def _latest(pieces: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last run of each piece name (a piece run again replaces its earlier file)."""

    def started(x: dict[str, Any]) -> str:
        stages = (x.get("run") or {}).get("stages") or {}
        return max((str(s.get("started")) for s in stages.values()), default="")

    latest = {x["piece"]: x for x in sorted(pieces, key=started)}
    return sorted(latest.values(), key=started)


def group_pieces(pieces: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Pieces by identity (GPU model, revision, software set): one report each."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for x in _latest(pieces):
        groups.setdefault(identity_key(x["run"].get("identity") or {}), []).append(x)
    return groups


def merge_pieces(pieces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from the pieces of one identity. Incomplete pieces (a store stage
    whose restore stage has not run, a failed start) are left out and listed."""
    pieces = _latest(pieces)
    keys = {identity_key(x["run"].get("identity") or {}) for x in pieces}
    if len(keys) > 1:
        raise MergeError(f"pieces of {len(keys)} revisions, software sets or GPU models")
    peers = {x["run"]["peers"]["lmcache056"] for x in pieces if (x["run"].get("peers") or {})}
    if len(peers) > 1:
        raise MergeError(f"lmcache 0.5.6 pieces of several versions: {sorted(peers)}")
    res: dict[str, Any] = {"schema": SCHEMA, "created": _dt.date.today().isoformat()}
    res.update(identity=pieces[0]["run"].get("identity") if pieces else None)
    res.update(runs=[], rows={}, left_out=[])
    for piece in pieces:
        if not piece.get("complete"):
            res["left_out"].append(piece["piece"])
            continue
        run = {"piece": piece["piece"], **piece["run"]}
        res["runs"].append(run)
        for key, row in piece["rows"].items():
            restores = [{**x, "ceiling": run.get("ceiling")} for x in row.get("restores") or []]
            res["rows"][key] = {**row, "piece": piece["piece"], "restores": restores}
    pool_colds(res["rows"])
    summarize(res)
    return res


def pool_colds(rows: dict[str, dict[str, Any]]) -> None:
    """A ``cold`` row per model, length and mode: every piece's no-connector colds, shown
    beside the arms (each arm's ratios use its own piece's)."""
    for r in list(rows.values()):
        if r["arm"] == "cold" or not r.get("baseline_colds"):
            continue
        key = f"{r['model']}:{r['prompt_tokens']}:cold:{r['mode']}"
        cold = rows.setdefault(key, {**{k: r[k] for k in ("model", "prompt_tokens", "mode")}})
        cold.update(arm="cold", errors=[], findings=[], restores=[])
        if r["piece"] not in cold.setdefault("pieces", []):
            cold["pieces"].append(r["piece"])
            cold.setdefault("baseline_colds", []).extend(r["baseline_colds"])


def _median(values: Iterable[float | None]) -> float | None:
    return spread(values)["median"]


def summarize(results: dict[str, Any]) -> None:
    """Per row: spreads of the proven, correct restores, of the no-connector colds and of the
    colds with the connector storing; the fixed cost (the engine's time on a hit already in
    GPU memory), each restore's floor; the speedup over the no-connector cold; the cost of a
    miss."""
    rows = results["rows"]
    for r in rows.values():
        restores = r.get("restores") or []
        which = "page_cache_gbps" if r["arm"] == "pagecache" else "disk_gbps"
        good = [x for x in restores if x.get("proven") and x.get("correct")]
        r["fixed_s"] = _median(r.get("fixed_probes") or [])
        for x in restores:
            gbps = (x.get("ceiling") or {}).get(which)
            x["floor_s"] = floor_s(x.get("needed_bytes"), gbps, r["fixed_s"])
            ttft = x.get("ttft_s")
            x["floor_over_restore"] = x["floor_s"] / ttft if x["floor_s"] and ttft else None
        r["restore_ttft"] = spread(x["ttft_s"] for x in good)
        r["floor_over_restore"] = spread(x["floor_over_restore"] for x in good)
        r["needed_bytes"] = _median(x.get("needed_bytes") for x in good)
        r["restores_counted"] = f"{len(good)} of {len(restores)}" if restores else None
        r["baseline_ttft"] = spread(r.get("baseline_colds") or [])
        r["miss_ttft"] = spread(r.get("colds_in_engine") or [])
        base, med = r["baseline_ttft"]["median"], r["restore_ttft"]["median"]
        miss = r["miss_ttft"]["median"]
        r["speedup"] = base / med if base and med else None
        r["miss_cost"] = miss / base if base and miss else None
    results["findings"] = [f for r in sorted(rows.values(), key=sort_key) for f in r["findings"]]


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**missed**")


def targets(results: dict[str, Any]) -> list[str]:
    """bench/README.md's targets, evaluated on the CUDA-graph rows of the main model; every
    ratio inside one piece."""
    rows = {
        (r["prompt_tokens"], r["arm"]): r
        for r in results["rows"].values()
        if r["model"] == MAIN_MODEL and r["mode"] == "graphs"
    }

    def get(p: int, arm: str, key: str) -> Any:
        value = (rows.get((p, arm)) or {}).get(key)
        return value.get("median") if isinstance(value, dict) else value

    def exact(p: int, arm: str) -> bool:
        r = rows.get((p, arm)) or {}
        return bool(r.get("restores")) and all(x.get("correct") for x in r["restores"])

    out = []
    for p in (26624, 65536, 131072):
        f = get(p, "default", "floor_over_restore")
        ok = None if f is None else f >= FLOOR_TARGET
        out.append(
            f"- disk restore >= {FLOOR_TARGET} of its floor at {p}: {_verdict(ok)} ({fmt(f)})"
        )
    for p, arm, x in ((26624, "pagecache", 15), (131072, "default", 6)):
        s = get(p, arm, "speedup")
        out.append(
            f"- {arm} >= {x}x the no-connector cold at {p}: "
            f"{_verdict(None if s is None else s >= x)} ({fmt(s)}x)"
        )
    for p in sorted({p for p, _ in rows}):
        ours = get(p, "default", "restore_ttft") if exact(p, "default") else None
        for peer in ("offloading", "lmcache056"):
            theirs = get(p, peer, "restore_ttft")
            ok = None if ours is None or theirs is None else ours < theirs
            out.append(
                f"- faster than {peer} at {p} (exact KV): {_verdict(ok)} "
                f"({fmt(ours)} s vs {fmt(theirs)} s)"
            )
    for p in (26624, 131072):
        c = get(p, "default", "miss_cost")
        ok = None if c is None else c <= MISS_TARGET
        out.append(
            f"- a miss with the connector storing <= {MISS_TARGET}x the no-connector cold at "
            f"{p}: {_verdict(ok)} ({fmt(c)}x)"
        )
    return out


HEADER = (
    "model | prompt | arm | mode | hit | no-connector cold s | restore s | counted | speedup"
    " | miss s (connector storing) | miss / cold | GB needed | fixed s"
    " | floor/restore median (min) | KV exact | errors"
)
MISS_HEADER = (
    "model | prompt | arm | mode | cold s | miss s | extra s | connector calls s"
    " | top calls s | server copies s | median step s cold / miss | last L2 write s"
)


def _sp(s: dict[str, Any] | None) -> str:
    s = s or {}
    return f"{fmt(s.get('median'))} ({fmt(s.get('min'))}-{fmt(s.get('max'))})"


def _run_line(run: dict[str, Any]) -> str:
    c, host = run.get("ceiling") or {}, run.get("host") or {}
    modes = {
        role: f"{e.get('read_back')}"
        + (f", {e['cut_by_deadline']} cut" if e.get("cut_by_deadline") else "")
        for role, e in (run.get("engines") or {}).items()
    }
    started = [s.get("started") for s in (run.get("stages") or {}).values()]
    return (
        f"- {run.get('piece')} ({', '.join(map(str, started))}): host {host.get('host_id')} "
        f"boot {host.get('boot_id')}, {host.get('cpus_usable')} of {host.get('cores')} CPUs, "
        f"driver {first_gpu(run).get('driver')}, code {run.get('code')}; disk ceiling "
        f"{fmt(c.get('disk_gbps'))} GB/s, page cache {fmt(c.get('page_cache_gbps'))} GB/s; "
        f"engines {modes}; disk plan {run.get('disk_plan')}"
    )


def _miss_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    for r in rows:
        s = (r.get("miss_path") or {}).get("summary") or {}
        if not s:
            continue
        top = sorted((s.get("by_method_s") or {}).items(), key=lambda kv: -(kv[1] or 0))[:3]
        out.append(
            [
                r["model"],
                r["prompt_tokens"],
                r["arm"],
                r["mode"],
                s.get("baseline_ttft_s"),
                s.get("miss_ttft_s"),
                s.get("extra_s"),
                s.get("connector_s"),
                ", ".join(f"{m} {fmt(v)}" for m, v in top) or None,
                s.get("server_store_s"),
                f"{fmt(s.get('baseline_step_s'))} / {fmt(s.get('miss_step_s'))}",
                s.get("writes_last_s"),
            ]
        )
    return out


def markdown_report(results: dict[str, Any]) -> str:
    ident = results.get("identity") or {}
    lines = [f"# GPU restore bench ({results.get('created')})", ""]
    lines += [f"- GPU model: {ident.get('gpu_model')}; this wheel: {ident.get('revision')}"]
    lines += [f"- software: {ident.get('software')}"]
    lines += [_run_line(run) for run in results.get("runs") or []]
    if len({run.get("code") for run in results.get("runs") or []}) > 1:
        lines.append("- the pieces ran different bench code (their `code` digests differ)")
    if results.get("left_out"):
        lines.append(f"- left out, incomplete: {', '.join(results['left_out'])}")
    lines += ["", "TTFT s, median (min-max). Speedup = the no-connector cold of the same piece /"]
    lines += ["the restore; miss = a cold with the connector storing, in the restore engine."]
    lines += ["Floor = the bytes of the hit's objects / the read ceiling + the fixed cost (a hit"]
    lines += ["already in vLLM's GPU prefix cache, same engine); counted: restores whose source"]
    lines += ["is proven and whose restored KV bytes are exact.", ""]
    table, ordered = [], sorted(results["rows"].values(), key=sort_key)
    for r in ordered:
        hits = {x.get("hit_tokens") for x in r.get("restores") or []}
        ratio = r.get("floor_over_restore") or {}
        table.append(
            [
                r["model"],
                r["prompt_tokens"],
                r["arm"],
                r["mode"],
                ",".join(map(str, sorted(h for h in hits if h is not None))) or None,
                _sp(r.get("baseline_ttft")),
                _sp(r.get("restore_ttft")),
                r.get("restores_counted"),
                r.get("speedup"),
                _sp(r.get("miss_ttft")),
                r.get("miss_cost"),
                r["needed_bytes"] / GB if r.get("needed_bytes") else None,
                r.get("fixed_s"),
                f"{fmt(ratio.get('median'))} ({fmt(ratio.get('min'))})",
                all(x.get("kv_match") for x in r["restores"]) if r.get("restores") else None,
                "; ".join(r.get("errors") or [])[:200],
            ]
        )
    lines += md_table(HEADER.split(" | "), table)
    lines += ["", "## The miss path (medians over the colds of each piece)", ""]
    lines += md_table(MISS_HEADER.split(" | "), _miss_rows(ordered))
    lines += ["", "## Targets (bench/README.md)", "", *targets(results)]
    found = [
        f"- {f['model']} {f['prompt_tokens']} {f['arm']} {f['mode']}: {f['what'][:600]}"
        for f in results.get("findings") or []
    ]
    return "\n".join(lines + ["", "## Findings", "", *(found or ["- none"])]) + "\n"


def write_results(results: dict[str, Any], path: Path) -> str:
    """<stem>.json, <stem>.md and, where matplotlib imports, <stem>-ttft.png, -floor.png;
    returns what became of the plots."""
    path.parent.mkdir(parents=True, exist_ok=True)
    results["plots"] = write_plots(results, path)
    write_json_md(path.with_suffix(""), results, markdown_report(results))
    return results["plots"]


def write_merged(pieces: Iterable[dict[str, Any]], path: Path) -> list[tuple[Path, str]]:
    """One report per identity: at ``path`` when the pieces share one, else beside it with
    the GPU model and the identity's key in the name."""
    groups = group_pieces(pieces)
    out = []
    for key, group in groups.items():
        target = path
        if len(groups) > 1:
            gpu = str((group[0]["run"].get("identity") or {}).get("gpu_model") or "gpu")
            slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
            target = path.with_name(f"{path.stem}-{slug}-{key}{path.suffix}")
        out.append((target, write_results(merge_pieces(group), target)))
    return out


def write_plots(results: dict[str, Any], path: Path) -> str:
    """TTFT per arm and mode against prompt length (with the no-connector colds and the
    misses); each counted restore against its floor."""
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
        k, name = r["prompt_tokens"] / 1024, f"{r['model']} {r['mode']}"
        if r["arm"] == "cold" and (c := r["baseline_ttft"]["median"]):
            series.setdefault(f"{name} cold, no connector", []).append((k, c))
        elif (t := r["restore_ttft"]["median"]) is not None:
            series.setdefault(f"{name} {r['arm']}", []).append((k, t))
        if r["arm"] == "default" and (c := r["miss_ttft"]["median"]):
            series.setdefault(f"{name} miss, connector storing", []).append((k, c))
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
