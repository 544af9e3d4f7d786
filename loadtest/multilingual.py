"""Non-English transcription, language ID and translation on ``../shared/corpus-multilingual``:
the service against faster-whisper on the same model folder.

    . scripts/env.sh && .venv/bin/python -m loadtest.multilingual \
        --out loadtest/results/multilingual.json

Every clip is transcribed with no language given; the clips with a published English
translation are also translated (``task=translate``), again with no language. Systems:

- ``fw_default``: faster-whisper ``WhisperModel(model_dir, device="cpu", compute_type="int8",
  cpu_threads=--threads).transcribe(path, task=...)`` at its defaults (beam 5, temperature
  fallback, timestamps, previous-text conditioning, no VAD), one clip at a time. Its fallback
  samples, so each task runs on a fresh model created after ``ctranslate2.set_random_seed``.
- ``http``: a real ``python -m app`` (``loadtest.lib.service.Server``: free port, temporary data dir,
  ``--server-env K=V``), ``POST /transcribe?wait=true`` with the form field ``task`` only,
  ``--concurrency`` clips in flight so the micro-batcher pools them (the service's default beam:
  1 for English, ``DEFAULT_BEAM_SIZE_OTHER`` (5) for the rest).
- ``http_beam1``: the same server and requests with ``beam_size=1`` (the default before it
  depended on the language): what the wider beam buys, and its wall time.
- ``http_beam5``: the same server and requests with ``beam_size=5``: like for like with
  faster-whisper's beam 5.
- ``fw_shift5ms`` and ``fw_dither``: controls, faster-whisper exactly as ``fw_default`` on audio
  changed in a way nobody can hear: 5 ms of silence before it (half a mel hop, so every frame
  sees other samples), or +-1 least significant bit of 16-bit audio (-90 dBFS, seeded). Where
  a control trails ``fw_default`` in a language, the engine lost to itself there: that is how
  far one decode of the same weights moves a language's error rate on this corpus.

``--variants N`` runs ``--variant-systems`` again on N-1 inaudibly changed copies of every clip
and scores each language over all N versions (:mod:`loadtest.lib.mlvariants`): the comparison with
the decoder's own noise averaged out.

Scoring is the project's one scorer (app/client/scoring.py: the corpus README's rules), tabled
by ``loadtest.lib.mlresults``. The output holds, per system,
every clip's texts, per-language error rates and their mean, language-ID accuracy, chrF/BLEU,
wall seconds; the differences of each service system from ``fw_default``; the commit, whether
the tree was clean and the command. ``<out>.md`` has the table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.lib import mlvariants
from loadtest.lib.common import allocator, machine_info, resolve_model
from loadtest.lib.corpus import ML_CORPUS, Clip, load_ml_corpus
from loadtest.lib.mlresults import (
    against,
    language,
    metric,
    paired_bootstrap,
    score,
    spread,
    summary,
)
from loadtest.lib.mlvariants import dither, shift

SYSTEMS = ("fw_default", "http", "http_beam1", "http_beam5", "fw_shift5ms", "fw_dither")
HTTP_FORMS: dict[str, dict[str, str]] = {"http": {}, "http_beam1": {"beam_size": "1"},
                                         "http_beam5": {"beam_size": "5"}}
SEED = 1234
TASKS = ("transcribe", "translate")


def clips_for(clips: Sequence[Clip], task: str) -> list[Clip]:
    return [c for c in clips if task == "transcribe" or c.translation]


def _empty() -> dict[str, Any]:
    return {"transcripts": {}, "languages": {}, "translations": {}, "clip_info": {},
            "seconds": {}}


def _store(out: dict[str, Any], c: Clip, task: str, text: str, info: dict[str, Any]) -> None:
    out["transcripts" if task == "transcribe" else "translations"][c.id] = text
    if task == "transcribe" and info.get("language"):
        out["languages"][c.id] = info["language"]
    out["clip_info"].setdefault(c.id, {})[task] = info


# ---- faster-whisper -----------------------------------------------------------------------------
CONTROLS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"fw_shift5ms": shift,
                                                          "fw_dither": dither}


def run_fw(clips: Sequence[Clip], model_dir: str, threads: int, seed: int,
           tasks: Sequence[str] = TASKS,
           perturb: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Any]:
    """One clip at a time at faster-whisper's defaults; ``perturb``: its own decoded audio
    (``decode_audio``, what ``transcribe(path)`` reads), changed before it is transcribed."""
    import ctranslate2
    from faster_whisper import WhisperModel, decode_audio

    out = {"kwargs": {}, "seed": seed, **_empty()}
    for task in tasks:
        ctranslate2.set_random_seed(seed)  # seeds the generator of the model created next
        model = WhisperModel(model_dir, device="cpu", compute_type="int8", cpu_threads=threads)
        t0 = time.perf_counter()
        for c in clips_for(clips, task):
            c0 = time.perf_counter()
            audio = str(c.path) if perturb is None else perturb(decode_audio(str(c.path)))
            segments, info = model.transcribe(audio, task=task)
            segs = list(segments)  # the generator does the work
            text = " ".join(s.text.strip() for s in segs).strip()
            _store(out, c, task, text, {
                "language": info.language,
                "language_probability": round(info.language_probability, 4),
                "segments": len(segs), "tokens": sum(len(s.tokens) for s in segs),
                "temperatures": sorted({s.temperature for s in segs}),
                "seconds": round(time.perf_counter() - c0, 2)})
        out["seconds"][task] = round(time.perf_counter() - t0, 2)
        del model
    return out


def fw_seeds(clips: Sequence[Clip], model_dir: str, threads: int, main: dict[str, Any],
             seeds: Sequence[int]) -> dict[str, Any]:
    """faster-whisper's translation under other seeds. Where a decode is unsure (avg logprob
    < -1) it samples (temperatures 0.2 .. 1.0, best of 5) and keeps the likeliest decode, so
    its chrF is one draw: at seed 1234, 6 of the 12 translations ran the whole ladder to 1.0,
    while no transcript fell back (its transcripts do not depend on the seed). The spread says
    how far one draw can sit from another."""
    from loadtest.lib.mlresults import translation_scores

    per: dict[str, Any] = {str(main["seed"]): translation_scores(clips, main["translations"])}
    for seed in seeds:
        out = run_fw(clips, model_dir, threads, seed, tasks=("translate",))
        per[str(seed)] = translation_scores(clips, out["translations"])
        print(f"fw seed {seed}: chrF {per[str(seed)]['chrf']}", file=sys.stderr, flush=True)
    chrf = [v["chrf"] for v in per.values()]
    bleu = [v["bleu"] for v in per.values()]
    return {"seeds": per, "chrf_mean": round(sum(chrf) / len(chrf), 2), "chrf_min": min(chrf),
            "chrf_max": max(chrf), "bleu_mean": round(sum(bleu) / len(bleu), 2)}


# ---- the service over HTTP ----------------------------------------------------------------------
def _post(client: Any, c: Clip, task: str, form: dict[str, str]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    with open(c.path, "rb") as f:
        r = client.post("/transcribe", params={"wait": "true"},
                        files={"file": (c.path.name, f)}, data={"task": task, **form})
    r.raise_for_status()
    job = r.json()
    while job["status"] not in ("done", "failed", "cancelled"):  # ?wait timed out: poll
        time.sleep(1.0)
        job = client.get(job["status_url"]).raise_for_status().json()
    if job["status"] != "done":
        raise RuntimeError(f"{c.id} {task}: job {job['status']}: {job.get('error')}")
    return job["result"], time.perf_counter() - t0


def run_http(clips: Sequence[Clip], url: str, form: dict[str, str],
             concurrency: int) -> dict[str, Any]:
    """Each task's clips, ``concurrency`` requests in flight (longest first, so the tail is
    short clips)."""
    import httpx

    out = {"form": form, "concurrency": concurrency, **_empty()}
    with httpx.Client(base_url=url, timeout=900) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        for task in TASKS:
            todo = sorted(clips_for(clips, task), key=lambda c: -c.duration_s)
            t0 = time.perf_counter()
            answers = pool.map(_post, [client] * len(todo), todo, [task] * len(todo),
                               [form] * len(todo))
            for c, (res, secs) in zip(todo, answers, strict=True):
                _store(out, c, task, res["text"].strip(), {
                    "language": res["language"],
                    "language_probability": res["language_probability"],
                    "segments": len(res["segments"]),
                    "tokens": sum(len(s["tokens"]) for s in res["segments"]),
                    "latency_s": round(secs, 2)})
            out["seconds"][task] = round(time.perf_counter() - t0, 2)
    return out


def run_service(clips: Sequence[Clip], names: Sequence[str], env: dict[str, str],
                concurrency: int) -> dict[str, dict[str, Any]]:
    """One server for every ``http*`` system, warmed up with one untimed request."""
    from loadtest.lib.service import Server

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ml-http-") as tmp:
        server = Server(Path(tmp), env=env).start()
        try:
            import httpx

            with httpx.Client(base_url=server.url, timeout=900) as client:
                _post(client, min(clips, key=lambda c: c.duration_s), "transcribe", {})
            for name in names:
                t0 = time.perf_counter()
                results[name] = run_http(clips, server.url, HTTP_FORMS[name], concurrency)
                results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
            for r in results.values():
                r["server_env"] = env
                r["server_peak_rss_mb"] = server.peak_rss_mb()
        except Exception:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
    return results


def variants(clips: Sequence[Clip], args: argparse.Namespace, env: dict[str, str],
             runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``--variant-systems`` on the clips' copies (:mod:`loadtest.lib.mlvariants`), scored with
    their outputs on the clips themselves (``runs``)."""
    names = [n for n in args.variant_systems.split(",") if n]
    if bad := [n for n in names if n not in runs or n not in ("fw_default", *HTTP_FORMS)]:
        raise SystemExit(f"--variant-systems {bad}: fw_default or http* systems also in "
                         "--systems")
    more: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ml-variants-") as tmp:
        extra = mlvariants.copies(clips, args.variants, Path(tmp))
        if "fw_default" in names:
            t0 = time.perf_counter()
            more["fw_default"] = run_fw(extra, resolve_model(args.model), args.threads,
                                        args.seed)
            more["fw_default"]["wall_s"] = round(time.perf_counter() - t0, 1)
        if http := [n for n in names if n in HTTP_FORMS]:
            more.update(run_service(extra, http, env, args.concurrency))
    out = mlvariants.pooled(clips, extra, runs, more, args.variants)
    for name, v in out["systems"].items():
        print(f"{name} over {args.variants} versions", json.dumps(v["summary"]), flush=True)
    return out


# ---- report -------------------------------------------------------------------------------------
def _fmt(x: Any, sign: bool = False) -> str:
    return "–" if x is None else (f"{x:+.1f}" if sign else f"{x:.1f}")


def markdown(result: dict[str, Any], clips: Sequence[Clip]) -> str:
    names = list(result["systems"])
    summ = result["summary"]
    count = {lang: sum(language(c) == lang for c in clips) for lang in {language(c) for c in clips}}
    head = ["lang (metric, clips)", *names]
    lines = [f"Multilingual corpus: {len(clips)} clips, {result['translation_clips']} translated; "
             f"model {result['model']}; commit {result['machine']['git']} "
             f"(clean tree: {result['machine']['git_clean']}). Error % (lower is better); "
             "no language given.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for lang in sorted(count, key=lambda k: (-count[k], k)):
        lines.append(f"| {lang} ({metric(lang).upper()}, {count[lang]}) | "
                     + " | ".join(_fmt(summ[n]["per_lang"].get(lang)) for n in names) + " |")
    rows = (("mean error over languages", "mean_err_lang"), ("mean error, no number clips",
            "mean_err_lang_no_numbers"), ("language ID %", "lid"),
            ("translation chrF", "chrf"), ("translation BLEU", "bleu"))
    for label, key in rows:
        lines.append(f"| **{label}** | " + " | ".join(_fmt(summ[n][key]) for n in names) + " |")
    lines.append("| wall s | " + " | ".join(_fmt(result["systems"][n]["wall_s"]) for n in names)
                 + " |")
    if result.get("against_fw_default"):
        lines += ["", "Each system − fw_default (error points: negative is better; LID, chrF, "
                  "BLEU: positive is better). The fw_* controls are faster-whisper against "
                  "itself on audio changed inaudibly:", ""]
        for n, d in result["against_fw_default"].items():
            lines.append(f"- `{n}`: mean error {_fmt(d['mean_err_lang'], True)}, LID "
                         f"{_fmt(d['lid'], True)}, chrF {_fmt(d['chrf'], True)}, BLEU "
                         f"{_fmt(d['bleu'], True)}; more errors in "
                         f"{', '.join(d.get('trails_in', [])) or 'no language'}, fewer in "
                         f"{', '.join(d.get('ahead_in', [])) or 'no language'}")
    if seeds := result.get("fw_translation_seeds"):
        lines += ["", f"faster-whisper's translation samples where unsure, so its chrF is one "
                  f"draw: over seeds {', '.join(seeds['seeds'])}, chrF mean "
                  f"{_fmt(seeds['chrf_mean'])} (min {_fmt(seeds['chrf_min'])}, max "
                  f"{_fmt(seeds['chrf_max'])}), BLEU mean {_fmt(seeds['bleu_mean'])}."]
    if result.get("variants"):
        lines += mlvariants.markdown(result["variants"], clips)
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------
def pick_clips(clips: list[Clip], spec: str | None) -> list[Clip]:
    """``--clips``: a number (a subset spread over the languages) or comma-separated ids."""
    if not spec:
        return clips
    if spec.isdigit():
        return spread(clips, int(spec))
    keep = set(spec.split(","))
    unknown = keep - {c.id for c in clips}
    if unknown:
        raise SystemExit(f"unknown clip ids: {', '.join(sorted(unknown))}")
    return [c for c in clips if c.id in keep]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.multilingual", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--threads", type=int, default=2, help="faster-whisper's cpu_threads")
    p.add_argument("--concurrency", type=int, default=4, help="HTTP requests in flight")
    p.add_argument("--server-env", action="append", default=[], metavar="K=V",
                   help="environment of the service (repeatable)")
    p.add_argument("--seed", type=int, default=SEED, help="CTranslate2 seed for fw's fallback")
    p.add_argument("--fw-seeds", default="1,2,3,4",
                   help="more seeds for faster-whisper's translation ('' : none)")
    p.add_argument("--clips", default=None,
                   help="N (a subset spread over the languages) or comma-separated ids")
    p.add_argument("--variants", type=int, default=1, metavar="N",
                   help="also run --variant-systems on N-1 inaudibly changed copies of every "
                        "clip and score each language over all N versions (loadtest.lib.mlvariants)")
    p.add_argument("--variant-systems", default="fw_default,http",
                   help="the systems run on the copies (fw_default and http* ones)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/multilingual.json"))
    args = p.parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    if unknown := [n for n in names if n not in SYSTEMS]:
        raise SystemExit(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")

    clips = pick_clips(load_ml_corpus(), args.clips)
    model_dir = resolve_model(args.model)
    env = {"BATCHSCRIBE_MODEL__NAME": args.model,
           **dict(kv.split("=", 1) for kv in args.server_env)}
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "loadtest.multilingual",
                               *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(), "allocator": allocator(), "model": args.model,
        "model_dir": model_dir, "corpus": str(ML_CORPUS), "seed": args.seed,
        "clips": len(clips), "clip_ids": [c.id for c in clips],
        "translation_clips": len(clips_for(clips, "translate")),
        "audio_s": round(sum(c.duration_s for c in clips), 3), "systems": {},
    }
    result["commit"], result["clean_tree"] = result["machine"]["git"], result["machine"]["git_clean"]
    runs: dict[str, dict[str, Any]] = {}
    if "fw_default" in names:
        t0 = time.perf_counter()
        runs["fw_default"] = run_fw(clips, model_dir, args.threads, args.seed)
        runs["fw_default"]["wall_s"] = round(time.perf_counter() - t0, 1)
        if args.fw_seeds:
            result["fw_translation_seeds"] = fw_seeds(
                clips, model_dir, args.threads, runs["fw_default"],
                [int(x) for x in args.fw_seeds.split(",")])
    for name in (n for n in names if n in CONTROLS):
        t0 = time.perf_counter()
        runs[name] = run_fw(clips, model_dir, args.threads, args.seed, perturb=CONTROLS[name])
        runs[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    if http := [n for n in names if n in HTTP_FORMS]:
        runs.update(run_service(clips, http, env, args.concurrency))
    for name in names:
        out = runs[name]
        out["score"] = score(clips, out)
        result["systems"][name] = out
        print(name, json.dumps(summary(out["score"])), flush=True)
    result["summary"] = {k: summary(v["score"]) for k, v in result["systems"].items()}
    if "fw_default" in runs:
        base = runs["fw_default"]
        result["against_fw_default"] = {
            n: {**against(result["summary"][n], result["summary"]["fw_default"]),
                "paired_bootstrap": paired_bootstrap(clips, runs[n], base)}
            for n in names if n != "fw_default"}
    if args.variants > 1:
        result["variants"] = variants(clips, args, env, runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    md = args.out.with_name(args.out.name + ".md") if args.out.suffix != ".json" \
        else args.out.with_suffix(".md")
    md.write_text(markdown(result, clips))
    print(f"results: {args.out}, {md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
