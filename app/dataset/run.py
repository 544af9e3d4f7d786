"""``batchscribe dataset MANIFEST -o OUT --ray [ADDRESS]``: the manifest through Ray Data.

The same input (app/client/manifest.py) and the same output rows, summary and exit status as
the HTTP dataset mode; the service's pipeline runs inside Ray actors instead of behind HTTP
(app/dataset/stage.py), one per GPU or one per CPU node (app/dataset/plan.py). ADDRESS is any
``ray.init`` address (``auto``, ``ray://head:10001``, ``head:6379``); without one a local Ray is
started on this machine's CPUs. On a cluster every node needs batchscribe and the model
(``python -m models.provision whisper-base``), and the manifest's audio must be readable at the
same paths (a shared file system) or be URLs.

Progress lives in ``OUT.parts/`` (app/dataset/parts.py): one part file per block of rows,
named by the rows it holds. ``--resume`` after a kill transcribes only the rows no part holds;
failed rows are kept as failed unless ``--retry-failed``. ``OUT`` and ``OUT.summary.json`` are
written from the parts at the end of every run (also after Ctrl-C), in input order.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from app.client.checkpoint import State
from app.client.manifest import ManifestError, load
from app.client.progress import Progress, render, summary, write_summary
from app.config import Settings
from app.dataset.parts import PartStore, Scan, key
from app.dataset.plan import Plan, nodes, plan
from app.dataset.stage import ROW_AUDIO, ROW_JSON, ROW_STEM, Transcriber

ID = "_id"


def connect(address: str) -> None:
    """Join the cluster at ``address``, or start a local Ray ("local"); no-op if connected."""
    try:
        import ray
    except ImportError as exc:
        raise ManifestError("--ray needs Ray: pip install 'batchscribe[ray]'") from exc

    if ray.is_initialized():
        return
    if address == "local":  # no dashboard: CPU the engine needs
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)


def run_ray(args: argparse.Namespace) -> int:
    subtitles = tuple(f for f in (x.strip() for x in args.subtitles.split(",")) if f)
    if set(subtitles) - {"srt", "vtt"}:
        raise ManifestError(f"--subtitles takes srt and/or vtt, not {args.subtitles!r}")
    manifest = load(args.input, args.text_key)
    out: Path = args.output
    store = PartStore(out.with_name(out.name + ".parts"))
    word_timestamps = bool(args.words or subtitles)
    header = {"input": manifest.source, "input_digest": manifest.digest,
              "rows": len(manifest.rows), "language": args.language, "task": args.task,
              "word_timestamps": word_timestamps, "diarize": False}
    store.start(header, args.resume, args.overwrite)
    before = store.scan()
    todo = [r for r in manifest.rows if (rec := before.records.get(key(r.index))) is None
            or (args.retry_failed and rec.get("error") is not None)]
    durations = [r.duration for r in manifest.rows]
    progress = Progress(
        len(manifest.rows), None if None in durations else sum(d or 0.0 for d in durations),
        files_done=len(before.done),
        failed=len(before.failed) - (sum(1 for r in todo if key(r.index) in before.records)),
        audio_done_s=sum(float(r["facts"].get("audio_s") or 0.0) for r in before.done.values()),
        show=sys.stderr.isatty() if args.progress is None else args.progress,
        log_every_s=args.log_every if args.progress is not False else 0.0)
    started = time.monotonic()
    interrupted = False
    layout: Plan | None = None
    try:
        if todo:
            connect(args.ray)
            # The settings tree reads BATCHSCRIBE_MODEL__DEVICE (and refuses a typo) as the
            # actors will, so the plan and the actors agree on the device.
            layout = plan(nodes(), Settings().model.device, args.actors, args.batch_rows)
            print(f"ray: {layout.describe()}", file=sys.stderr)
            stems = manifest.subtitle_stems() if subtitles else {}
            items = [{ID: r.index, ROW_JSON: json.dumps(r.fields, ensure_ascii=False),
                      ROW_AUDIO: r.audio, ROW_STEM: stems.get(r.index, "")} for r in todo]
            stage = {"language": args.language, "task": args.task, "text_key": args.text_key,
                     "pred_key": args.pred_key, "segments": args.segments, "words": args.words,
                     "subtitles": subtitles, "id_key": ID, "parts_dir": str(store.root),
                     "subs_dir": str(out.with_name(out.name + ".subs")) if subtitles else None,
                     "slim": True}
            for batch in transcribe(items, stage, layout):
                ok = batch["error"].isna()
                progress.update(files=int(ok.sum()), audio_s=float(batch["audio_s"][ok].sum()),
                                failed=int((~ok).sum()))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
        final = store.scan()
        store.assemble(out, [r.index for r in manifest.rows], final)
        s = summary(state_of(header, final), {r.index: r.fields["audio_filepath"]
                                              for r in manifest.rows},
                    time.monotonic() - started, progress.run_audio_s, progress.run_files, out,
                    interrupted)
        s["ray"] = {"plan": layout.describe() if layout else None, "parts": final.parts,
                    "ids_in_two_parts": len(final.duplicates())}
        write_summary(out.with_suffix(".summary.json"), s)
        print(render(s), file=sys.stderr)
    if interrupted:
        print("interrupted: --resume transcribes the rows no part holds yet", file=sys.stderr)
        return 130
    return 0 if s["done"] == len(manifest.rows) else 1


def transcribe(items: list[dict[str, Any]], stage: dict[str, Any], layout: Plan) -> Any:
    """The rows through the stage; yields the stage's (slim) output batches as they finish."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    blocks = max(1, math.ceil(len(items) / layout.batch_rows))
    source = ray.data.from_items(items, override_num_blocks=blocks)
    ds = source.map_batches(Transcriber, fn_constructor_kwargs=stage, **layout.map_kwargs(),
                        runtime_env={"env_vars": layout.env})
    yield from ds.iter_batches(batch_size=None, batch_format="pandas")


def state_of(header: dict[str, Any], scan: Scan) -> State:
    """The parts as app/client/progress.summary reads a checkpoint (done and failed rows)."""
    st = State(header)
    for rec in scan.records.values():
        if rec.get("error") is None:
            st.done[int(rec["id"])] = dict(rec["facts"])
        else:
            st.failed[int(rec["id"])] = (0, str(rec["error"]))
    return st
