// The page at /: upload files, follow each job's event stream, show and download transcripts,
// and show the service's state. Plain browser JavaScript, no build step, no dependencies.
//
// API keys: EventSource cannot send an Authorization header, so the job event stream is read
// with fetch() and a stream reader, which can. The key lives in sessionStorage (this tab only).
// Browsers open at most 6 HTTP/1.1 connections per host and every followed job holds one, so at
// most STREAMS streams are open at once; the other jobs wait for a free one.
"use strict";

const KEY_STORE = "batchscribe.key";
const STATUS_EVERY_MS = 2000;
const RECONNECT_MS = 2000; // the server's retry hint for a dropped event stream
const STREAMS = 3;
const FINAL = new Set(["done", "failed", "cancelled"]);

let apiKey = sessionStorage.getItem(KEY_STORE) || "";
const $ = (id) => document.getElementById(id);

class NeedKey extends Error {}

// ---- requests -------------------------------------------------------------------------------
function authHeaders(extra) {
  const h = new Headers(extra || {});
  if (apiKey) h.set("Authorization", "Bearer " + apiKey);
  return h;
}

async function api(path, init = {}) {
  const res = await fetch(path, { ...init, headers: authHeaders(init.headers) });
  if (res.status === 401) {
    askForKey(apiKey ? "The key was not accepted." : "");
    throw new NeedKey("an API key is needed");
  }
  return res;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || `${res.status} ${res.statusText}`;
  } catch {
    return `${res.status} ${res.statusText}`;
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- the key --------------------------------------------------------------------------------
function askForKey(message) {
  const form = $("key-form");
  if (form.hidden) { // not again on every status poll: the user may be typing
    form.hidden = false;
    $("work").hidden = true;
    $("key").focus();
  }
  if (message) $("key-error").textContent = message;
}

async function useKey(event) {
  event.preventDefault();
  apiKey = $("key").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  try {
    await refreshStatus();
    $("key-form").hidden = true;
    $("work").hidden = false;
  } catch (e) {
    if (!(e instanceof NeedKey)) $("key-error").textContent = String(e.message || e);
  }
}

// ---- service state --------------------------------------------------------------------------
const fmt = (x, digits, unit) => (x === null || x === undefined ? "–" : x.toFixed(digits) + (unit || ""));

async function refreshStatus() {
  const res = await api("/status");
  if (!res.ok) throw new Error(await errorText(res));
  const s = await res.json();
  $("st-ready").textContent = s.ready ? "ready" : "not ready";
  $("st-ready").className = s.ready ? "ok" : "error";
  $("st-backlog").textContent = fmt(s.backlog_s, 0, " s of audio");
  $("st-pending").textContent = String(s.pending_windows);
  const jobs = Object.entries(s.jobs).filter(([, n]) => n > 0).map(([k, n]) => `${n} ${k}`);
  $("st-jobs").textContent = jobs.length ? jobs.join(", ") : "none";
  $("st-throughput").textContent = fmt(s.throughput, 1, "× real time");
  $("st-rtf").textContent = fmt(s.rtf, 1, "×");
  $("st-batch").textContent = fmt(s.batch_size, 1, " windows");
  $("st-model").textContent = `${s.model} on ${s.device}, ${s.workers} worker(s)`;
  document.body.dataset.statusAt = String(Date.now());
}

async function pollStatus() {
  for (;;) {
    try {
      await refreshStatus();
    } catch (e) {
      if (!(e instanceof NeedKey)) $("st-ready").textContent = "unreachable";
    }
    await sleep(STATUS_EVERY_MS);
  }
}

// ---- options --------------------------------------------------------------------------------
function jobForm(file) {
  const form = new FormData();
  form.append("file", file, file.name);
  const lang = $("opt-language").value.trim();
  if (lang && lang !== "auto") form.append("language", lang);
  form.append("task", $("opt-task").value);
  form.append("word_timestamps", $("opt-words").checked ? "true" : "false");
  if ($("opt-speakers").checked) form.append("diarize", "true");
  for (const [id, field] of [["opt-prompt", "initial_prompt"], ["opt-hotwords", "hotwords"]]) {
    const v = $(id).value.trim();
    if (v) form.append(field, v);
  }
  return form;
}

function cueParams() {
  const p = new URLSearchParams();
  for (const [id, name] of [["opt-width", "max_line_width"], ["opt-lines", "max_line_count"],
                            ["opt-cue", "max_cue_s"]]) {
    const v = $(id).value.trim();
    if (v) p.set(name, v);
  }
  return p;
}

// ---- one file -------------------------------------------------------------------------------
class JobView {
  constructor(file) {
    this.file = file;
    this.el = $("job-template").content.firstElementChild.cloneNode(true);
    this.q = (sel) => this.el.querySelector(sel);
    this.q(".name").textContent = file.name;
    this.q(".cancel").addEventListener("click", () => this.cancel());
    for (const b of this.el.querySelectorAll(".downloads button")) {
      b.addEventListener("click", () => this.download(b.dataset.format));
    }
    this.setState("waiting", "waiting to upload");
    $("jobs").append(this.el);
  }

  setState(state, detail) {
    this.el.dataset.state = state;
    this.q(".state").textContent = state;
    if (detail !== undefined) this.q(".detail").textContent = detail;
  }

  progress(done, total) {
    const bar = this.q("progress");
    bar.max = Math.max(total, 1);
    bar.value = done;
  }

  upload() {
    // XMLHttpRequest, not fetch: it reports upload progress.
    return new Promise((resolve, reject) => {
      const xhr = new XMLHttpRequest();
      xhr.open("POST", "/transcribe");
      if (apiKey) xhr.setRequestHeader("Authorization", "Bearer " + apiKey);
      xhr.upload.onprogress = (e) => {
        if (e.lengthComputable) {
          this.progress(e.loaded, e.total);
          this.q(".detail").textContent = `uploading ${Math.round((100 * e.loaded) / e.total)} %`;
        }
      };
      xhr.onerror = () => reject(new Error("upload failed: the service is unreachable"));
      xhr.onload = () => {
        let body = null;
        try { body = JSON.parse(xhr.responseText); } catch { /* not JSON */ }
        if (xhr.status === 401) {
          askForKey(apiKey ? "The key was not accepted." : "");
          reject(new NeedKey("an API key is needed"));
        } else if (xhr.status === 202 || xhr.status === 200) {
          resolve(body);
        } else {
          const err = new Error((body && body.error && body.error.message) || `HTTP ${xhr.status}`);
          err.retryAfter = Number(xhr.getResponseHeader("Retry-After")) || 0;
          err.status = xhr.status;
          reject(err);
        }
      };
      xhr.send(jobForm(this.file));
    });
  }

  async submit() {
    this.setState("uploading", "uploading");
    for (;;) {
      try {
        const job = await this.upload();
        this.job = job;
        this.el.dataset.jobId = job.id;
        this.progress(0, 1);
        this.setState(job.status, "accepted");
        return true;
      } catch (e) {
        if (e.status === 429 && e.retryAfter) { // the backlog is full: try again when it drains
          this.setState("waiting", `${e.message}; retrying in ${e.retryAfter} s`);
          await sleep(e.retryAfter * 1000);
          continue;
        }
        this.setState("failed", e.message);
        return false;
      }
    }
  }

  onEvent(name, data) {
    if (name === "progress") {
      const total = data.windows_total;
      this.el.dataset.progressEvents = String(Number(this.el.dataset.progressEvents || 0) + 1);
      this.progress(data.windows_done, total || 1);
      const of = total ? `${data.windows_done}/${total} windows` : "decoding the upload";
      this.setState(data.status, `${of}, ${data.audio_seconds.toFixed(1)} s of audio`);
    }
    return FINAL.has(name) ? name : null;
  }

  async follow() {
    for (;;) {
      let final = null;
      try {
        const res = await api(`/jobs/${this.job.id}/events`, { headers: { Accept: "text/event-stream" } });
        if (!res.ok) throw new Error(await errorText(res));
        final = await readEvents(res.body, (name, data) => this.onEvent(name, data));
      } catch (e) {
        if (e instanceof NeedKey) return null;
      }
      if (final) return final;
      await sleep(RECONNECT_MS); // the stream dropped (a restart, a proxy): resume it
    }
  }

  async finish(final) {
    if (final !== "done") {
      const res = await api(`/jobs/${this.job.id}`);
      const job = res.ok ? await res.json() : null;
      const why = job && job.error ? job.error.message : "";
      this.setState(final, why || final);
      return;
    }
    const res = await api(`/jobs/${this.job.id}/result?format=json`);
    if (!res.ok) {
      this.setState("failed", await errorText(res));
      return;
    }
    const result = await res.json();
    this.progress(1, 1);
    this.setState("done", `${result.duration.toFixed(1)} s, language ${result.language || "?"}`);
    this.showTranscript(result);
    this.q(".downloads").hidden = false;
    this.q(".cancel").hidden = true;
  }

  showTranscript(result) {
    // Diarized (or channels=separate): the text as speaker turns, each segment with its
    // speaker; segments with no words (a speaker turn the transcript has nothing for) are not
    // listed. Text, never markup.
    const box = this.q(".transcript");
    box.replaceChildren();
    const segments = result.segments.filter((s) => s.text.trim());
    const speakers = result.speakers || [];
    const text = document.createElement("div");
    text.className = "text";
    if (speakers.length) {
      for (const turn of speakerTurns(segments)) {
        const line = document.createElement("div");
        line.className = "turn";
        line.append(speakerLabel(turn.speaker), " ", turn.text);
        text.append(line);
      }
    } else {
      text.textContent = result.text;
    }
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = `${segments.length} segments` +
      (speakers.length ? `, ${speakers.length} speaker${speakers.length > 1 ? "s" : ""}` : "");
    details.append(summary);
    for (const s of segments) {
      const line = document.createElement("div");
      const t = document.createElement("time");
      t.textContent = `${clock(s.start)}–${clock(s.end)}`;
      line.append(t, " ");
      if (s.speaker) line.append(speakerLabel(s.speaker), " ");
      line.append(s.text.trim());
      details.append(line);
    }
    box.append(text, details);
  }

  async cancel() {
    if (!this.job) return;
    await api(`/jobs/${this.job.id}`, { method: "DELETE" });
  }

  async download(format) {
    const params = cueParams();
    params.set("format", format);
    const res = await api(`/jobs/${this.job.id}/result?${params}`);
    if (!res.ok) {
      this.q(".detail").textContent = await errorText(res);
      return;
    }
    const stem = this.file.name.replace(/\.[^.]*$/, "") || "transcript";
    save(await res.blob(), `${stem}.${format === "text" ? "txt" : format}`);
  }
}

// Consecutive segments of one speaker, joined: what a reader of a conversation wants.
function speakerTurns(segments) {
  const turns = [];
  for (const s of segments) {
    const last = turns[turns.length - 1];
    const who = s.speaker || "?";
    if (last && last.speaker === who) last.text += " " + s.text.trim();
    else turns.push({ speaker: who, text: s.text.trim() });
  }
  return turns;
}

function speakerLabel(name) {
  const el = document.createElement("span");
  el.className = "speaker";
  el.textContent = name;
  return el;
}

function clock(t) {
  const m = Math.floor(t / 60);
  return `${m}:${(t - 60 * m).toFixed(1).padStart(4, "0")}`;
}

function save(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

// Server-Sent Events from a fetch() body: calls onEvent(name, data) per event and returns the
// first non-null value it returns (the final status), or null if the stream ends before one.
async function readEvents(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let name = "message";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return null;
      buffer += value;
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).replace(/\r$/, "");
        buffer = buffer.slice(nl + 1);
        if (line === "") {
          if (data.length) {
            const out = onEvent(name, JSON.parse(data.join("\n")));
            if (out) return out;
          }
          name = "message";
          data = [];
        } else if (line.startsWith("event:")) {
          name = line.slice(6).trim();
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        } // comments (keep-alives), id: and retry: need nothing here
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// ---- the queue ------------------------------------------------------------------------------
let uploads = Promise.resolve();
let freeStreams = STREAMS;
const streamWaiters = [];

async function withStream(fn) {
  if (freeStreams > 0) freeStreams--;
  else await new Promise((r) => streamWaiters.push(r));
  try {
    return await fn();
  } finally {
    const next = streamWaiters.shift();
    if (next) next();
    else freeStreams++;
  }
}

function addFiles(files) {
  for (const file of files) {
    const view = new JobView(file);
    // Uploads go one after another (each is quick); their jobs then run side by side, which is
    // what lets the service batch them together.
    const accepted = (uploads = uploads.then(() => view.submit()));
    accepted.then(async (ok) => {
      if (!ok) return;
      const final = await withStream(() => view.follow());
      if (final) await view.finish(final);
    }).catch((e) => view.setState("failed", String(e.message || e)));
  }
}

function setUp() {
  $("key-form").addEventListener("submit", useKey);
  $("files").addEventListener("change", (e) => {
    addFiles([...e.target.files]);
    e.target.value = "";
  });
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => {
    e.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    addFiles([...e.dataTransfer.files]);
  });
  pollStatus();
}

document.addEventListener("DOMContentLoaded", setUp);
