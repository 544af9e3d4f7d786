"""The Ray Data stage: a callable class for ``Dataset.map_batches``, one model per actor.

    ds = ray.data.read_json("train.jsonl")          # NeMo manifest rows
    ds = ds.map_batches(Transcriber, fn_constructor_kwargs={"language": "en"},
                        batch_format="pandas", batch_size=16,
                        compute=ray.data.ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=4,
                                                           max_concurrent_calls_per_actor=4),
                        num_gpus=1)                 # or num_cpus=<the node's cores> on CPU

(:func:`app.dataset.plan.plan` picks those numbers for the cluster.) Each actor builds the
service's pipeline once (:class:`app.dataset.local.LocalPipeline`: the model on the actor's GPU
when Ray gave it one, warmed up and its batch cap sized as the service sizes it). ``__call__``
is a coroutine: Ray Data runs several batches of an actor at once, and their rows share the
actor's engine batches, so the engine keeps working while one batch's last windows finish (a
batch at a time would idle it for every batch's tail).

Output rows are those of ``batchscribe dataset`` (app/client/rows.py: the input's fields plus
``pred_text``, ``language``, ``duration`` when the input has none, ``rtf``, ``wer``/``cer`` and
the normaliser when there is a reference, optional ``segments``, ``words``, subtitle paths),
with ``diarize`` also ``speakers`` and ``segments`` with their ``speaker``; plus ``error``:
None, or why the row failed (its audio could not be read or decoded, in the service's words).
A failed row never fails the stage. With ``parts_dir`` (and ``id_key``), each
batch is also written as one part file named by its row ids (app/dataset/parts.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.client.manifest import Row, _language, _number, _text
from app.client.rows import Extras, output_row
from app.config import Settings
from app.dataset.inputs import (
    AUDIO_DATA_KEYS,
    Request,
    RowError,
    Spool,
    audio_source,
    describe,
    plain,
)
from app.dataset.local import Done, Job, LocalPipeline
from app.dataset.parts import PartStore
from app.engine.loading import load_whisper
from app.engine.startup import EngineFactory

# Columns the CLI sends (app/dataset/run.py): the manifest row's own JSON, kept byte for byte
# in the output; its resolved audio path; its subtitle file stem.
ROW_JSON, ROW_AUDIO, ROW_STEM = "_row_json", "_audio", "_stem"


class Transcriber:
    def __init__(self, *, language: str | None = None, task: str = "transcribe",
                 beam_size: int | None = None, word_timestamps: bool = False,
                 initial_prompt: str | None = None, diarize: bool = False,
                 num_speakers: int | None = None, min_speakers: int | None = None,
                 max_speakers: int | None = None, language_key: str | None = None,
                 prompt_key: str | None = None, text_key: str = "text",
                 pred_key: str = "pred_text", segments: bool = False, words: bool = False,
                 subtitles: Sequence[str] = (), subs_dir: str | None = None,
                 id_key: str | None = None, parts_dir: str | None = None,
                 base_dir: str | None = None, slim: bool = False,
                 settings: Settings | None = None,
                 engine_factory: EngineFactory = load_whisper) -> None:
        if parts_dir and not id_key:
            raise ValueError("parts_dir needs id_key: a part is named by the ids of its rows")
        self.request = Request(language, task, beam_size, word_timestamps or words
                               or bool(subtitles), initial_prompt, diarize, num_speakers,
                               min_speakers, max_speakers, language_key, prompt_key)
        self.extras = Extras(pred_key, segments, words, tuple(subtitles),
                             Path(subs_dir) if subs_dir else None)
        self.text_key, self.id_key, self.slim = text_key, id_key, slim
        self.parts = PartStore(Path(parts_dir)) if parts_dir else None
        self.pipeline = LocalPipeline(settings, engine_factory)  # the model, once per actor
        self.spool = Spool(self.pipeline.settings, Path(base_dir) if base_dir else None)

    async def __call__(self, batch: Any) -> Any:
        import pandas as pd

        rows = batch_rows(batch)
        results = await self.process(rows)
        if self.slim:  # what the CLI's driver needs: ids, audio seconds, errors
            assert self.id_key is not None
            return pd.DataFrame({self.id_key: [r["id"] for r in results],
                                 "audio_s": [r["facts"].get("audio_s", 0.0) for r in results],
                                 "error": [r["error"] for r in results]})
        return pd.DataFrame([{**(r["out"] or r["fields"]), "error": r["error"]}
                             for r in results])

    async def process(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """One record per row, in order: ``id``, ``out`` (the output row, None if it failed),
        ``error``, ``facts`` (audio seconds, the score), ``fields`` (the input's own). Written
        as one part first when the stage has a parts folder."""
        staged = await asyncio.gather(*(asyncio.to_thread(self._stage, r) for r in rows))
        jobs = [s["job"] for s in staged if s["job"] is not None]
        results: list[Done] = await asyncio.wrap_future(self.pipeline.submit(jobs)) if jobs else []
        done = iter(results)
        pairs = [(s, next(done) if s["job"] is not None else None) for s in staged]
        try:
            records = await asyncio.to_thread(lambda: [self._record(s, d) for s, d in pairs])
        finally:
            for s in staged:
                if s["job"] is not None:
                    self.spool.release(s["job"].path, s["spooled"])
        if self.parts is not None:
            parts = self.parts
            await asyncio.to_thread(parts.write, [{k: r[k] for k in ("id", "out", "error", "facts", "t")}
                                                  for r in records])
        return records

    def _stage(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The row's fields, id and audio (a local file), or its error. Blocking (downloads)."""
        if ROW_JSON in row:
            import json

            fields = json.loads(str(row[ROW_JSON]))
        else:
            fields = {str(k): plain(v) for k, v in row.items() if not _audio_data(k, v)}
        row_id = plain(row[self.id_key]) if self.id_key else None
        out: dict[str, Any] = {"fields": fields, "id": row_id, "job": None, "spooled": False,
                               "error": None, "stem": str(row.get(ROW_STEM) or "")}
        try:
            source = str(row[ROW_AUDIO]) if ROW_AUDIO in row else audio_source(row)
            out["audio"] = describe(source)
            path, out["spooled"] = self.spool.local(source)
        except RowError as exc:
            out["error"] = str(exc)
            out.setdefault("audio", "")
            return out
        opts = self.request.options(fields, self.pipeline.settings)
        out["job"] = Job(f"{row_id}:{path.name}", path, opts)
        return out

    def _record(self, staged: dict[str, Any], done: Done | None) -> dict[str, Any]:
        fields = staged["fields"]
        rec = {"id": staged["id"], "fields": fields, "out": None, "facts": {"audio_s": 0.0},
               "error": staged["error"], "t": round(done.finished if done else time.time(), 3)}
        if done is None or done.error is not None:
            rec["error"] = rec["error"] or (done.error if done else "not transcribed")
            return rec
        row = Row(int(staged["id"]) if isinstance(staged["id"], int) else 0, fields,
                  staged["audio"], _number(fields.get("duration")),
                  _text(fields.get(self.text_key)), _language(fields))
        job = {"result": done.result, "audio_seconds": done.audio_s, "rtf": done.rtf}
        stem = staged["stem"] or f"{Path(staged['audio'].split('?', 1)[0]).stem}-{staged['id']}"
        rec["out"], rec["facts"] = out, _ = output_row(row, job, self.extras, stem)
        result = done.result or {}
        if self.request.diarize:  # who spoke when: the segments with their speaker
            out["speakers"] = result.get("speakers") or []
            out["segments"] = [{"start": g["start"], "end": g["end"], "text": str(g["text"]).strip(),
                                "speaker": g.get("speaker")} for g in result.get("segments") or []]
        return rec

    def close(self) -> None:
        """Without Ray (tests, a notebook): free the model and the spool folder."""
        self.pipeline.close()
        self.spool.close()


def _audio_data(key: str, value: Any) -> bool:
    """Columns that hold audio itself, or the CLI's private columns: not copied to the output."""
    if key in (ROW_AUDIO, ROW_STEM):
        return True
    if key == "audio":
        return not isinstance(value, str)
    return key in AUDIO_DATA_KEYS


def batch_rows(batch: Any) -> list[dict[str, Any]]:
    """Rows of a Ray batch in any format (pandas, pyarrow, a dict of numpy arrays)."""
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return [dict(r) for r in batch.to_dict(orient="records")]
    if hasattr(batch, "to_pylist"):  # pyarrow
        return list(batch.to_pylist())
    if isinstance(batch, Mapping):
        cols = {str(k): v for k, v in batch.items()}
        n = len(next(iter(cols.values()))) if cols else 0
        return [{k: (v[i] if isinstance(v, np.ndarray | list) else v) for k, v in cols.items()}
                for i in range(n)]
    raise TypeError(f"unsupported batch format: {type(batch).__name__}")
