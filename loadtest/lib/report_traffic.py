"""The bench report's real-traffic part (issue 17): no language beside ``language=en``, what
cross-request batching and the dynamic time axis each buy, the long upload counted from its POST
and alone, memory with a multi-hour upload in flight, and WER per corpus set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.client.scoring import wer_percent
from loadtest.lib.corpus import READ_SPEECH, Clip

# The ``read speech`` group of :func:`wer_by_set` (its key in results files) holds the 20-60 s
# LibriVox recordings too, unlike READ_SPEECH elsewhere in the report: shown under this name.
READ_PLUS = "read speech + librivox_long"
TARGETS = {"no_language": 0.9, "long_alone": 0.8, "rss_growth_mb": 500.0, "wer_points": 0.3}
Check = Callable[..., None]


def wer_by_set(clips: list[Clip], texts: dict[str, str]) -> dict[str, Any]:
    """WER per corpus set, plus read speech (librispeech, ljspeech, librivox, librivox_long)."""
    groups: dict[str, list[Clip]] = {"read speech": [c for c in clips
                                                      if c.set in (*READ_SPEECH, "librivox_long")]}
    for c in clips:
        groups.setdefault(c.set, []).append(c)
    out = {}
    for name, members in groups.items():
        scored = [c for c in members if c.id in texts]
        out[name] = {"wer_percent": wer_percent([c.reference for c in scored],
                                                [texts[c.id] or "" for c in scored]),
                     "clips": len(scored)}
    return out


def _r(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def analyse_traffic(res: dict[str, Any], clips: list[Clip], check: Check,
                    limit: float | None) -> dict[str, Any]:
    svc = res.get("service", {})
    eng = res.get("engine") or {}
    out: dict[str, Any] = {}
    auto = svc.get("load", {}).get("throughput_x")
    en = svc.get("load_en", {}).get("throughput_x")
    out["no_language/en"] = _r(auto, en)
    check("no language ÷ language=en, same run", out["no_language/en"], TARGETS["no_language"])
    out["no_language/engine_limit"] = _r(auto, limit)
    for key in ("peer", "peer_matched"):
        out[f"service/{key}"] = _r(auto, ((res.get(key) or {}).get("load") or {}).get("throughput_x"))
    b1 = (eng.get("batch1") or {}).get("throughput_x")
    full = (eng.get("full_axis") or {}).get("throughput_x")
    out["engine_limit/batch1"] = _r(limit, b1)
    out["service/batch1"] = _r(en, b1)
    out["engine_limit/full_axis"] = _r(limit, full)
    idle = svc.get("idle", {}).get("latency_short", {}).get("p95_s")
    beside = svc.get("long", {}).get("latency_short", {}).get("p95_s")
    out["long_p95/idle_p95"] = _r(beside, idle)
    check("short p95 from a 20-min upload's POST ÷ idle p95", out["long_p95/idle_p95"], 3.0,
          higher=False)
    out["long_alone/engine_limit"] = _r(svc.get("long_alone", {}).get("throughput_x"), limit)
    check("a long upload alone ÷ engine limit", out["long_alone/engine_limit"],
          TARGETS["long_alone"])
    rss = res.get("rss") or {}
    growth = rss.get("growth_mb")
    check("peak RSS with a multi-hour upload − idle peak, MB", growth, TARGETS["rss_growth_mb"],
          higher=False)
    sets: dict[str, Any] = {}
    seq = res.get("baselines", {}).get("modes", {}).get("a", {}).get("texts")
    if seq:
        sets["sequential (a), language=en"] = wer_by_set(clips, seq)
    for name, key in (("service, language=en", "wer_pass_en"), ("service, no language", "wer_pass")):
        texts = (svc.get(key) or {}).get("texts")
        if texts:
            sets[name] = wer_by_set(clips, {k: v or "" for k, v in texts.items()})
    out["wer_by_set"] = sets

    def read(name: str) -> float | None:
        return (sets.get(name) or {}).get("read speech", {}).get("wer_percent")

    a, e, n = read("sequential (a), language=en"), read("service, language=en"), read(
        "service, no language")
    out["wer_no_language_minus_en_points"] = round(n - e, 3) if n is not None and e is not None else None
    out["wer_no_language_minus_sequential_points"] = (round(n - a, 3) if n is not None
                                                      and a is not None else None)
    check("WER no language − language=en, read speech, points",
          out["wer_no_language_minus_en_points"], TARGETS["wer_points"], higher=False)
    langs = (svc.get("wer_pass") or {}).get("languages") or {}
    out["detected_not_en"] = sorted(k for k, v in langs.items() if v != "en")
    return out


PEER_DECODES = {"peer": "its defaults (beam 5, no VAD)",
                "peer_matched": "the service's decode settings (beam 1, no timestamps, VAD)"}


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}x" if v >= 10 else f"{v:.3f}x"


def _ok(checks: dict[str, Any], name: str) -> str:
    c = checks.get(name)
    return "" if c is None or c["ok"] is None else ("pass" if c["ok"] else "**FAIL**")


def traffic_rows(res: dict[str, Any]) -> list[str]:
    """Rows of the bench's throughput table for real traffic (issue 17): no language sent, the
    peer, batch 1, the full axis, a long upload alone."""
    svc = res.get("service", {})
    eng = res.get("engine") or {}
    t = res.get("traffic", {})
    checks = {c["check"]: c for c in res.get("checks", [])}
    lines = []
    load, load_en = svc.get("load", {}), svc.get("load_en", {})
    if load:
        lines.append(f"| service, {load.get('clients')} clients, **no language** (detected), "
                     f"rounds {load.get('throughput_x_rounds')} | {_x(load.get('throughput_x'))} | "
                     f"{_x(t.get('no_language/en'))} of language=en ({_x(load_en.get('throughput_x'))}) "
                     f"| ≥ {TARGETS['no_language']}x | "
                     f"{_ok(checks, 'no language ÷ language=en, same run')} |")
    for key, decode in PEER_DECODES.items():
        peer = (res.get(key) or {}).get("load")
        if peer and load:
            p = res[key]
            lines.append(f"| peer: {p['settings']['package']} (its own venv), {peer.get('clients')} "
                         f"clients, no language, {decode}, {p['settings']['layout']} processes x "
                         f"threads | {_x(peer.get('throughput_x'))} | service (no language) ÷ "
                         f"peer {_x(t.get(f'service/{key}'))} | | context |")
    if eng.get("batch1"):
        lines.append(f"| engine, same config and windows, **batch 1** (what cross-request batching "
                     f"buys: limit ÷ this {_x(t.get('engine_limit/batch1'))}, service ÷ this "
                     f"{_x(t.get('service/batch1'))}) | {_x(eng['batch1']['throughput_x'])} | | | "
                     "context |")
    if eng.get("full_axis"):
        lines.append(f"| engine limit config on Whisper's **full 30 s axis** (what the dynamic "
                     f"axis buys: {_x(t.get('engine_limit/full_axis'))}) | "
                     f"{_x(eng['full_axis']['throughput_x'])} | | | context |")
    alone = svc.get("long_alone")
    if alone:
        lines.append(f"| a {alone['audio_s'] / 60:.0f} min upload alone, from its POST | "
                     f"{_x(alone['throughput_x'])} | {_x(t.get('long_alone/engine_limit'))} of the "
                     f"engine limit | ≥ {TARGETS['long_alone']}x | "
                     f"{_ok(checks, 'a long upload alone ÷ engine limit')} |")
    return lines


def latency_rows(res: dict[str, Any]) -> list[str]:
    """Rows of the bench's latency table (n, p50, p95, check) beyond idle and language=en."""
    svc = res.get("service", {})
    t = res.get("traffic", {})
    checks = {c["check"]: c for c in res.get("checks", [])}
    lines = []
    load = svc.get("load", {})
    if load.get("latency_short"):
        lat = load["latency_short"]
        lines.append(f"| {load.get('clients')} clients, no language | {lat.get('n')} | "
                     f"{lat.get('p50_s')} s | {lat.get('p95_s')} s | |")
    lng = svc.get("long")
    if lng:
        lat = lng["latency_short"]
        lines.append(f"| one client, from a {lng['long_audio_s'] / 60:.0f} min upload's POST (the "
                     f"upload kept in flight), no language | {lat.get('n')} | {lat.get('p50_s')} s | "
                     f"{lat.get('p95_s')} s | p95 {_x(t.get('long_p95/idle_p95'))} idle (≤ 3x) "
                     f"{_ok(checks, 'short p95 from a 20-min upload' + chr(39) + 's POST ÷ idle p95')} |")
    for key, decode in PEER_DECODES.items():
        peer = (res.get(key) or {}).get("load")
        if peer and load:
            p, lat = res[key], peer["latency_short"]
            lines.append(f"| peer, {decode.split(' (')[0]}, {peer.get('clients')} clients, no "
                         f"language ({peer.get('requests_failed')} failed; WER over the "
                         f"{p['wer'].get('clips_transcribed')} clips it finished "
                         f"{p['wer'].get('all', {}).get('wer_percent')} %, peak RSS "
                         f"{p.get('peak_rss_mb')} MB over its processes) | {lat.get('n', '–')} | "
                         f"{lat.get('p50_s')} s | {lat.get('p95_s')} s | |")
    return lines


def traffic_notes(res: dict[str, Any]) -> list[str]:
    """The memory sentence and the WER-by-set table."""
    t = res.get("traffic", {})
    checks = {c["check"]: c for c in res.get("checks", [])}
    lines: list[str] = []
    rss = res.get("rss")
    if rss:
        lines += ["", f"Memory: a fresh server's idle peak RSS {rss['idle_peak_rss_mb']} MB; with a "
                  f"{rss['audio_s'] / 3600:.1f} h upload (FLAC) in flight, peak "
                  f"{rss['peak_rss_mb']} MB: +{rss['growth_mb']} MB (target ≤ "
                  f"{TARGETS['rss_growth_mb']:.0f} MB) "
                  f"{_ok(checks, 'peak RSS with a multi-hour upload − idle peak, MB')}; that upload "
                  f"ran at {_x(rss['throughput_x'])} ({rss['status']})."]
    sets = t.get("wer_by_set") or {}
    if sets:
        names = list(next(iter(sets.values())).keys())
        shown = [READ_PLUS if n == "read speech" else n for n in names]
        lines += ["", "| WER % by set | " + " | ".join(shown) + " |",
                  "| --- |" + " --- |" * len(names)]
        for who, by in sets.items():
            cells = [by.get(n, {}).get("wer_percent") for n in names]
            lines.append(f"| {who} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells)
                         + " |")
        lines += ["", f"WER no language − language=en ({READ_PLUS}): "
                  f"{t.get('wer_no_language_minus_en_points')} points (≤ 0.3) "
                  f"{_ok(checks, 'WER no language − language=en, read speech, points')}; no "
                  f"language − sequential (a): {t.get('wer_no_language_minus_sequential_points')} "
                  f"points. Clips detected as another language than English: "
                  f"{t.get('detected_not_en') or 'none'}."]
    return lines
