"""The report of loadtest.bench: a bench result dict turned into the pass/fail analysis (ratios,
WER, the issue's checks), the Markdown table, and the README block between the bench markers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from loadtest.common import READ_SPEECH, SHORT_CLIP_S, Clip, layout_name
from loadtest.scoring import latency_summary, normaliser_name, wer_by_group

START_MARK, END_MARK = "<!-- bench:start -->", "<!-- bench:end -->"
TARGETS = {"a": 2.0, "b": 3.5, "c": 1.4, "engine": 0.9, "long_p95": 3.0, "wer_points": 0.3}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_latency(results: list[Any]) -> dict[str, Any]:
    return latency_summary([r.latency for r in results if r.ok])


def error_kinds(results: list[Any]) -> list[str]:
    return sorted({r.error or "" for r in results if not r.ok})[:5]


# ---- analysis ---------------------------------------------------------------------------------
def analyse(res: dict[str, Any], clips: list[Clip]) -> None:
    """Ratios, WER and the pass/fail checks of the issue, added to ``res`` in place."""
    svc = res.get("service", {})
    tput = svc.get("load", {}).get("throughput_x")
    base = res.get("baselines", {}).get("modes", {})
    best = (res.get("engine") or {}).get("best")
    ratios: dict[str, float | None] = {}
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, target: float, higher: bool = True) -> None:
        ok = None if value is None else (value >= target if higher else value <= target)
        checks.append({"check": name, "value": value, "target": ("≥ " if higher else "≤ ")
                       + str(target), "ok": ok})

    for k in ("a", "b", "c"):
        b = base.get(k, {}).get("throughput_x")
        ratios[f"service/{k}"] = round(tput / b, 3) if tput and b else None
        check(f"service / baseline ({k})", ratios[f"service/{k}"], TARGETS[k])
    ratios["service/engine_limit"] = (round(tput / best["throughput_x"], 3)
                                      if tput and best else None)
    check("service / engine limit", ratios["service/engine_limit"], TARGETS["engine"])
    arrival = (res.get("engine") or {}).get("arrival")
    ratios["service/engine_arrival_order"] = (round(tput / arrival["throughput_x"], 3)
                                              if tput and arrival else None)

    idle_p95 = svc.get("idle", {}).get("latency_short", {}).get("p95_s")
    long_p95 = svc.get("long", {}).get("latency_short", {}).get("p95_s")
    ratios["long_p95/idle_p95"] = round(long_p95 / idle_p95, 3) if idle_p95 and long_p95 else None
    check("short p95 beside a long file / idle p95", ratios["long_p95/idle_p95"],
          TARGETS["long_p95"], higher=False)

    wer: dict[str, Any] = {"normaliser": normaliser_name()}
    if "a" in base and "texts" in base["a"]:
        wer["sequential_a"] = wer_by_group(clips, base["a"]["texts"])
    if "b" in base and "texts" in base["b"]:
        wer["defaults_b"] = wer_by_group(clips, base["b"]["texts"])
    if best and "texts" in best:
        wer["engine_limit"] = wer_by_group(clips, best["texts"])
    if ((res.get("engine") or {}).get("sequential") or {}).get("texts"):
        wer["engine_b1"] = wer_by_group(clips, res["engine"]["sequential"]["texts"])
    if "wer_pass" in svc:
        wer["service"] = wer_by_group(clips, {k: v or "" for k, v in svc["wer_pass"]["texts"].items()})
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
    load = svc.get("load", {})
    base = res.get("baselines", {}).get("modes", {})
    best = (res.get("engine") or {}).get("best")
    checks = {c["check"]: c for c in res.get("checks", [])}
    r = res.get("ratios", {})
    lines = [
        f"Last run {m['finished']} on {mach['cpu']}, {mach['cores']} cores, {mach['memory_gb']} GB "
        f"(load average at start {mach['load_average_at_start'][0]}), Linux {mach['kernel']}, "
        f"Python {mach['python']}, CTranslate2 {v['ctranslate2']}, faster-whisper "
        f"{v['faster-whisper']}, whisperx {v['whisperx']}, commit {mach['git']}, "
        f"allocator {'glibc' if m['args']['no_tcmalloc'] else 'tcmalloc'}, model {st.get('model')} "
        f"int8, {res['corpus']['clips']} corpus clips ({res['corpus']['audio_s']:.0f} s) replayed.",
        "",
        f"Command: `{m['command']}` ({m['runtime_s'] / 60:.1f} min)",
        "",
        "| set-up | throughput (audio s / wall s) | service ÷ set-up | target | |",
        "| --- | --- | --- | --- | --- |",
        f"| **service**, {load.get('clients')} HTTP clients (cap {st.get('max_batch_size')}, "
        f"{layout_name(st.get('engines', 1), st.get('num_workers', 1), st.get('cpu_threads', 1))}, "
        f"max_wait {st.get('max_wait_ms')} ms) | **{_x(load.get('throughput_x'))}** | | | |",
    ]
    for k in ("a", "b", "c"):
        if k in base:
            c = checks.get(f"service / baseline ({k})")
            lines.append(f"| ({k}) {base[k]['label']} | {_x(base[k]['throughput_x'])} | "
                         f"{_x(r.get(f'service/{k}'))} | ≥ {TARGETS[k]}x | {_ok(c)} |")
    if best:
        c = checks.get("service / engine limit")
        lines.append(f"| engine limit: same windows offline, best of {len(res['engine']['configs'])}"
                     f" configs = {layout_name(best['engines'], best['workers'], best['threads'])}, batch "
                     f"{best['batch']} | {_x(best['throughput_x'])} | "
                     f"{_x(r.get('service/engine_limit'))} | ≥ {TARGETS['engine']}x | {_ok(c)} |")
    arrival = (res.get("engine") or {}).get("arrival")
    if arrival:
        lines.append(f"| engine, same config, windows batched in arrival order (not sorted) | "
                     f"{_x(arrival['throughput_x'])} | {_x(r.get('service/engine_arrival_order'))}"
                     f" | | context |")
    cpu = load.get("cpu")
    if cpu:
        lines += ["", f"Server CPU under load: {cpu['process_cores']} cores, of which its "
                  f"{cpu['engine_threads']} busiest threads (CTranslate2's workers) "
                  f"{cpu['engine_thread_cores']} and everything else (HTTP, job store, decode, "
                  f"VAD, mel, batching) {cpu['other_cores']}."]
    idle = svc.get("idle", {}).get("latency_short", {})
    lat_load = load.get("latency_short", {})
    lng = svc.get("long", {})
    lat_long = lng.get("latency_short", {})
    c = checks.get("short p95 beside a long file / idle p95")
    idle_p95 = idle.get("p95_s")
    extra = []
    for x in svc.get("long_extra", []):
        lx = x["latency_short"]
        ratio = lx["p95_s"] / idle_p95 if lx.get("p95_s") and idle_p95 else None
        extra.append(f"| one client while a {x['long_audio_s'] / 60:.0f} min file is in flight | "
                     f"{lx.get('n', '–')} | {_s(lx.get('p50_s'))} | {_s(lx.get('p95_s'))} | "
                     f"p95 {_x(ratio)} idle |")
    lines += [
        "",
        f"| latency of clips ≤ {SHORT_CLIP_S:.0f} s (upload to transcript) | n | p50 | p95 | |",
        "| --- | --- | --- | --- | --- |",
        f"| idle server, one client | {idle.get('n', '–')} | {_s(idle.get('p50_s'))} | "
        f"{_s(idle.get('p95_s'))} | |",
        *([f"| {load.get('clients')} clients replaying the corpus | {lat_load.get('n', '–')} | "
           f"{_s(lat_load.get('p50_s'))} | {_s(lat_load.get('p95_s'))} | |"] if load else []),
        f"| one client while a {lng.get('long_audio_s', 0) / 60:.0f} min file is in flight | "
        f"{lat_long.get('n', '–')} | {_s(lat_long.get('p50_s'))} | {_s(lat_long.get('p95_s'))} | "
        f"p95 {_x(r.get('long_p95/idle_p95'))} idle (target ≤ {TARGETS['long_p95']}x) {_ok(c)} |",
        *extra,
    ]
    wer = res.get("wer", {})

    def w(key: str, group: str = "read_speech") -> str:
        val = (wer.get(key) or {}).get(group, {}).get("wer_percent")
        return "–" if val is None else f"{val:.2f}"

    c = checks.get("WER service − sequential (a), read speech, points")
    lines += [
        "",
        f"| WER % ({wer.get('normaliser')}) | read speech ({'+'.join(READ_SPEECH)}) | other sets |",
        "| --- | --- | --- |",
        f"| (a) sequential, service settings | {w('sequential_a')} | {w('sequential_a', 'other_sets')} |",
    ]
    if "defaults_b" in wer:
        lines.append(f"| (b) faster-whisper defaults | {w('defaults_b')} | – |")
    if "engine_b1" in wer:
        lines.append(f"| engine, same windows, batch 1 | {w('engine_b1')} | "
                     f"{w('engine_b1', 'other_sets')} |")
    lines += [
        f"| engine limit config | {w('engine_limit')} | {w('engine_limit', 'other_sets')} |",
        f"| service (batched) | {w('service')} | {w('service', 'other_sets')} |",
        "",
        f"WER service − sequential (a): {wer.get('service_minus_sequential_points')} points "
        f"(target ≤ {TARGETS['wer_points']}) {_ok(c)}; service − same windows one at a time: "
        f"{wer.get('service_minus_same_windows_b1_points')} points "
        f"{_ok(checks.get('WER service − same windows one at a time, read speech, points'))}. "
        f"Transcripts changed by batching (engine limit config vs batch 1): "
        f"{wer.get('engine_best_transcripts_changed_vs_b1', '–')} of "
        f"{wer.get('engine_transcripts_compared', '–')}; load-phase transcripts differing from the "
        f"WER pass: {load.get('transcripts_differing_from_wer_pass')} of "
        f"{load.get('transcripts_compared')}.",
        "",
        f"Server peak RSS {svc.get('peak_rss_mb')} MB (after the load phase "
        f"{svc.get('peak_rss_load_mb')} MB); baselines peak RSS "
        + ", ".join(f"({k}) {base[k]['peak_rss_mb']} MB" for k in base)
        + (f"; engine limit config {best['peak_rss_mb']} MB" if best else "") + ".",
        "",
        f"Batch sizes under load (windows: batches): {load.get('batch_size', {}).get('distribution')}"
        f", mean {load.get('batch_size', {}).get('mean')}; mean batch fill (speech / 30 s "
        f"padding) {load.get('batch_fill', {}).get('mean')}.",
    ]
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
