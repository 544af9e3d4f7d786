"""The report of loadtest.bench: a bench result dict turned into the pass/fail analysis (ratios,
WER, the issue's checks), the Markdown table, and the README block between the bench markers.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.client.scoring import normaliser_name
from loadtest.lib.common import layout_name
from loadtest.lib.corpus import READ_SPEECH, SHORT_CLIP_S, Clip
from loadtest.lib.report_traffic import analyse_traffic, latency_rows, traffic_notes, traffic_rows
from loadtest.lib.stats import latency_summary, wer_by_group

START_MARK, END_MARK = "<!-- bench:start -->", "<!-- bench:end -->"
TARGETS = {"a": 2.0, "b": 3.5, "c": 1.4, "engine": 0.9, "wer_points": 0.3}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_latency(results: list[Any]) -> dict[str, Any]:
    return latency_summary([r.latency for r in results if r.ok])


def error_kinds(results: list[Any]) -> list[str]:
    return sorted({r.error or "" for r in results if not r.ok})[:5]


# ---- rounds -----------------------------------------------------------------------------------
def _bucket_order(label: str) -> float:
    """Where a histogram label (``"5-6"``, ``"<=0.5"``, ``"17-inf"``) sorts: its first bound."""
    m = re.search(r"inf|\d+(?:\.\d+)?", label)
    return float("inf") if m is None or m.group() == "inf" else float(m.group())


def _sum_histograms(hists: Sequence[dict[str, Any]]) -> dict[str, Any]:
    count = sum(h["count"] for h in hists)
    total = sum(h["count"] * h["mean"] for h in hists if h["count"])
    dist: dict[str, int] = {}
    for h in hists:
        for k, n in h["distribution"].items():
            dist[k] = dist.get(k, 0) + n
    return {"count": count, "mean": round(total / count, 3) if count else None,
            "distribution": dict(sorted(dist.items(), key=lambda kv: _bucket_order(kv[0])))}


def combine_rounds(loads: Sequence[dict[str, Any]], latencies: Sequence[float],
                   short_latencies: Sequence[float]) -> dict[str, Any]:
    """Several closed-loop rounds as one load result. Throughput is the median round's (one
    60 s window on a shared VM moves by a few %); latencies are pooled over every round's
    requests; batch histograms are summed; CPU is the mean of the rounds."""
    first = loads[0]
    cpus = [x["cpu"] for x in loads if x.get("cpu")]
    cpu = None
    if cpus:
        cpu = {k: round(statistics.fmean(c[k] for c in cpus), 3)
               for k in ("process_cores", "engine_thread_cores", "other_cores", "children_cores",
                         "engine_preempted_per_s") if all(k in c for c in cpus)}
        cpu["engine_threads"] = cpus[0]["engine_threads"]
    return {
        "clients": first["clients"], "warmup_s": first["warmup_s"],
        "duration_s": first["duration_s"], "rounds": len(loads),
        "throughput_x": round(statistics.median(x["throughput_x"] for x in loads), 3),
        "throughput_x_rounds": [x["throughput_x"] for x in loads],
        **{k: sum(x[k] for x in loads) for k in ("audio_s", "requests_ok", "requests_failed",
                                                   "transcripts_differing_from_wer_pass",
                                                   "transcripts_compared") if k in first},
        "errors": sorted({e for x in loads for e in x["errors"]})[:5],
        "latency_all": latency_summary(latencies),
        "latency_short": latency_summary(short_latencies),
        **{k: _sum_histograms([x[k] for x in loads])
           for k in ("batch_size", "batch_fill", "queue_wait", "batch_duration")},
        "engine_audio_s": round(sum(x["engine_audio_s"] for x in loads), 3),
        "cpu": cpu,
    }


def engine_limit(res: dict[str, Any]) -> tuple[float | None, list[float]]:
    """The engine limit the service is compared with, and the per-round values behind it.

    The sweep only *selects* the best configuration: the largest of several noisy
    measurements is biased up. That configuration is then re-measured right before each
    service round, and the median of those runs is the limit (the sweep's best value when
    there were no rounds)."""
    rounds = [r["engine_limit"]["throughput_x"] for r in res.get("service", {}).get("rounds", [])
              if r.get("engine_limit")]
    if rounds:
        return round(statistics.median(rounds), 3), rounds
    best = (res.get("engine") or {}).get("best")
    return (best["throughput_x"] if best else None), []


# ---- analysis ---------------------------------------------------------------------------------
def analyse(res: dict[str, Any], clips: list[Clip]) -> None:
    """Ratios, WER and the pass/fail checks of the issue, added to ``res`` in place."""
    svc = res.get("service", {})
    # Against the offline phases (which pass language=en): the language=en rounds.
    tput = svc.get("load_en", svc.get("load", {})).get("throughput_x")
    base = res.get("baselines", {}).get("modes", {})
    best = (res.get("engine") or {}).get("best")
    ratios: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, target: float, higher: bool = True) -> None:
        ok = None if value is None else (value >= target if higher else value <= target)
        checks.append({"check": name, "value": value, "target": ("≥ " if higher else "≤ ")
                       + str(target), "ok": ok})

    for k in ("a", "b", "c"):
        b = base.get(k, {}).get("throughput_x")
        ratios[f"service/{k}"] = round(tput / b, 3) if tput and b else None
        check(f"service / baseline ({k})", ratios[f"service/{k}"], TARGETS[k])
    limit, limit_rounds = engine_limit(res)
    ratios["engine_limit_x"] = limit
    ratios["service/engine_limit"] = round(tput / limit, 3) if tput and limit else None
    check("service / engine limit", ratios["service/engine_limit"], TARGETS["engine"])
    loads = svc.get("load_en", svc.get("load", {})).get("throughput_x_rounds", [])
    if limit_rounds and len(loads) == len(limit_rounds):
        ratios["service/engine_limit_rounds"] = [round(s / e, 3)
                                                 for s, e in zip(loads, limit_rounds, strict=True)]
    if tput and best:
        ratios["service/engine_limit_sweep"] = round(tput / best["throughput_x"], 3)
    arrival = (res.get("engine") or {}).get("arrival")
    ratios["service/engine_arrival_order"] = (round(tput / arrival["throughput_x"], 3)
                                              if tput and arrival else None)

    res["traffic"] = analyse_traffic(res, clips, check, limit)

    wer: dict[str, Any] = {"normaliser": normaliser_name()}
    if "a" in base and "texts" in base["a"]:
        wer["sequential_a"] = wer_by_group(clips, base["a"]["texts"])
    if "b" in base and "texts" in base["b"]:
        wer["defaults_b"] = wer_by_group(clips, base["b"]["texts"])
    if best and "texts" in best:
        wer["engine_limit"] = wer_by_group(clips, best["texts"])
    if ((res.get("engine") or {}).get("sequential") or {}).get("texts"):
        wer["engine_b1"] = wer_by_group(clips, res["engine"]["sequential"]["texts"])
    passed = svc.get("wer_pass_en") or svc.get("wer_pass")
    if passed:
        wer["service"] = wer_by_group(clips, {k: v or "" for k, v in passed["texts"].items()})
    seq = (wer.get("sequential_a") or {}).get("read_speech", {}).get("wer_percent")
    srv = (wer.get("service") or {}).get("read_speech", {}).get("wer_percent")
    delta = round(srv - seq, 3) if seq is not None and srv is not None else None
    wer["service_minus_sequential_points"] = delta
    check("WER service − sequential (a), read speech, points", delta, TARGETS["wer_points"],
          higher=False)
    same = (wer.get("engine_b1") or {}).get("read_speech", {}).get("wer_percent")
    delta_same = round(srv - same, 3) if same is not None and srv is not None else None
    wer["service_minus_same_windows_b1_points"] = delta_same
    check("WER service − same windows one at a time, read speech, points", delta_same,
          TARGETS["wer_points"], higher=False)
    seq_texts = ((res.get("engine") or {}).get("sequential") or {}).get("texts")
    if seq_texts and best and "texts" in best:
        wer["engine_best_transcripts_changed_vs_b1"] = sum(
            1 for k, v in best["texts"].items() if v.strip() != seq_texts.get(k, "").strip())
        wer["engine_transcripts_compared"] = len(best["texts"])
    res["ratios"], res["wer"], res["checks"] = ratios, wer, checks


def _x(v: float | None, suffix: str = "x") -> str:
    return "–" if v is None else f"{v:.1f}{suffix}" if v >= 10 else f"{v:.2f}{suffix}"


def _x3(v: float | None) -> str:
    """A ratio checked against a threshold: three decimals, so 0.899 never reads as 0.90."""
    return "–" if v is None else f"{v:.3f}x"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


def _ok(c: dict[str, Any] | None) -> str:
    return "" if c is None or c["ok"] is None else ("pass" if c["ok"] else "**FAIL**")


def render_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    mach = m["machine"]
    v = mach["versions"]
    svc = res.get("service", {})
    st = svc.get("settings", {})
    load = svc.get("load_en", svc.get("load", {}))
    base = res.get("baselines", {}).get("modes", {})
    best = (res.get("engine") or {}).get("best")
    checks = {c["check"]: c for c in res.get("checks", [])}
    r = res.get("ratios", {})
    lines = [
        f"Last run {m['finished']} on {mach['cpu']}, {mach['cores']} cores, {mach['memory_gb']} GB "
        f"(load average at start {mach['load_average_at_start'][0]}), Linux {mach['kernel']}, "
        f"Python {mach['python']}, CTranslate2 {v['ctranslate2']}, faster-whisper "
        f"{v['faster-whisper']}, whisperx {v['whisperx']}, commit {mach['git']} "
        f"({'clean tree' if mach.get('git_clean') else 'tree NOT clean'}), "
        f"allocator {'glibc' if m['args']['no_tcmalloc'] else 'tcmalloc'}, model {st.get('model')} "
        f"int8, {res['corpus']['clips']} corpus clips ({res['corpus']['audio_s']:.0f} s) replayed. "
        f"Command: `{m['command']}` ({m['runtime_s'] / 60:.1f} min).",
        "",
        "| set-up | throughput (audio s / wall s) | service ÷ set-up | target | |",
        "| --- | --- | --- | --- | --- |",
        f"| **service**, {load.get('clients')} HTTP clients, language=en (cap "
        f"{st.get('max_batch_size')}, "
        f"{layout_name(st.get('engines', 1), st.get('num_workers', 1), st.get('cpu_threads', 1))}, "
        f"max_wait {st.get('max_wait_ms')} ms"
        + (f"; median of {load['rounds']} rounds" if load.get("rounds", 1) > 1 else "")
        + f") | **{_x(load.get('throughput_x'))}** | | | |",
    ]
    for k in ("a", "b", "c"):
        if k in base:
            c = checks.get(f"service / baseline ({k})")
            lines.append(f"| ({k}) {base[k]['label']} | {_x(base[k]['throughput_x'])} | "
                         f"{_x(r.get(f'service/{k}'))} | ≥ {TARGETS[k]}x | {_ok(c)} |")
    if best:
        c = checks.get("service / engine limit")
        config = (f"best of {len(res['engine']['configs'])} configs = "
                  f"{layout_name(best['engines'], best['workers'], best['threads'])}, batch "
                  f"{best['batch']}")
        rounds = r.get("service/engine_limit_rounds")
        label = (f"{config} (sweep {_x(best['throughput_x'])}), re-run before each service round,"
                 f" median of {len(rounds)}" if rounds else config)
        lines.append(f"| engine limit: same windows offline, {label} | "
                     f"{_x(r.get('engine_limit_x'))} | {_x3(r.get('service/engine_limit'))} | "
                     f"≥ {TARGETS['engine']}x | {_ok(c)} |")
    arrival = (res.get("engine") or {}).get("arrival")
    if arrival:
        lines.append(f"| engine, same config, windows batched in arrival order (not sorted) | "
                     f"{_x(arrival['throughput_x'])} | {_x(r.get('service/engine_arrival_order'))}"
                     f" | | context |")
    lines += traffic_rows(res)
    notes = []
    rounds = svc.get("rounds", [])
    if len(rounds) > 1:
        per = r.get("service/engine_limit_rounds") or []
        notes.append(f"Service rounds ({load.get('duration_s', 0):.0f} s each after a "
                     f"{load.get('warmup_s', 0):.0f} s warm-up; the table gives the medians): "
                     + "; ".join(
                         f"{k + 1}: service {_x(x['load']['throughput_x'])}"
                         + (f", engine limit just before {_x(x['engine_limit']['throughput_x'])},"
                            f" ratio {per[k]:.3f}" if x.get("engine_limit") and k < len(per) else "")
                         for k, x in enumerate(rounds)) + ".")
    cpu = load.get("cpu")
    if cpu:
        notes.append(f"Server CPU under load: {cpu['process_cores']} cores, of which its "
                     f"{cpu['engine_threads']} busiest threads (CTranslate2's workers) "
                     f"{cpu['engine_thread_cores']} and everything else (HTTP, job store, "
                     f"batching, results) {cpu['other_cores']}"
                     + (f"; its prep processes (decode, VAD, cut) {cpu['children_cores']}"
                        if "children_cores" in cpu else "") + ".")
    notes.append(f"Batch sizes under load (windows: batches): "
                 f"{load.get('batch_size', {}).get('distribution')}, mean "
                 f"{load.get('batch_size', {}).get('mean')}; mean batch fill (speech / 30 s "
                 f"padding) {load.get('batch_fill', {}).get('mean')}.")
    idle = svc.get("idle", {}).get("latency_short", {})
    lat_load = load.get("latency_short", {})
    lines += [
        "", " ".join(notes), "",
        f"| latency of clips ≤ {SHORT_CLIP_S:.0f} s (from the POST) | n | p50 | p95 | |",
        "| --- | --- | --- | --- | --- |",
        f"| idle server, one client, no language | {idle.get('n', '–')} | {_s(idle.get('p50_s'))} | "
        f"{_s(idle.get('p95_s'))} | |",
        *([f"| {load.get('clients')} clients replaying the corpus, language=en | "
           f"{lat_load.get('n', '–')} | {_s(lat_load.get('p50_s'))} | {_s(lat_load.get('p95_s'))} | |"]
          if load else []),
        *latency_rows(res),
    ]
    wer = res.get("wer", {})

    def w(key: str, group: str = "read_speech") -> str:
        val = (wer.get(key) or {}).get(group, {}).get("wer_percent")
        return "–" if val is None else f"{val:.2f}"

    c = checks.get("WER service − sequential (a), read speech, points")
    lines += [
        "",
        f"WER % ({wer.get('normaliser')}), read speech ({'+'.join(READ_SPEECH)}) / other sets: "
        f"(a) sequential, service settings {w('sequential_a')} / {w('sequential_a', 'other_sets')}"
        + (f"; (b) faster-whisper defaults {w('defaults_b')}" if "defaults_b" in wer else "")
        + (f"; engine, same windows, batch 1 {w('engine_b1')} / {w('engine_b1', 'other_sets')}"
           if "engine_b1" in wer else "")
        + f"; engine limit config {w('engine_limit')} / {w('engine_limit', 'other_sets')}; "
        f"service (batched) {w('service')} / {w('service', 'other_sets')}. "
        f"Service − sequential (a): {wer.get('service_minus_sequential_points')} points "
        f"(target ≤ {TARGETS['wer_points']}) {_ok(c)}; service − same windows one at a time: "
        f"{wer.get('service_minus_same_windows_b1_points')} points "
        f"{_ok(checks.get('WER service − same windows one at a time, read speech, points'))}. "
        f"Transcripts changed by batching (engine limit config vs batch 1): "
        f"{wer.get('engine_best_transcripts_changed_vs_b1', '–')} of "
        f"{wer.get('engine_transcripts_compared', '–')}; load-phase transcripts differing from the "
        f"WER pass: {load.get('transcripts_differing_from_wer_pass')} of "
        f"{load.get('transcripts_compared')}. "
        f"Server peak RSS {svc.get('peak_rss_mb')} MB (after the load phase "
        f"{svc.get('peak_rss_load_mb')} MB); baselines peak RSS "
        + ", ".join(f"({k}) {base[k]['peak_rss_mb']} MB" for k in base)
        + (f"; engine limit config {best['peak_rss_mb']} MB" if best else "") + ".",
    ]
    lines += traffic_notes(res)
    return "\n".join(lines) + "\n"


def replace_readme(readme: Path, md: str) -> bool:
    if not readme.is_file():
        log(f"{readme} not found; README not updated")
        return False
    text = readme.read_text()
    a, b = text.find(START_MARK), text.find(END_MARK)
    if a < 0 or b < a:
        log(f"{readme} has no {START_MARK} ... {END_MARK} section; README not updated")
        return False
    readme.write_text(text[:a + len(START_MARK)] + "\n" + md + text[b:])
    log(f"{readme}: benchmark section replaced")
    return True
