// Live transcription on the page: the microphone streamed over OpenAI's Realtime protocol
// (/v1/realtime?intent=transcription), interim text shown as it comes, final text per turn.
//
// A browser's WebSocket cannot send an Authorization header, so the page first asks the service
// for a short-lived client secret (POST /v1/realtime/client_secrets, with the key as every call
// does) and offers it as the subprotocol "openai-insecure-api-key.<secret>", as OpenAI's own
// browser clients do. Audio: an AudioContext at 24 kHz (the browser resamples the microphone),
// an AudioWorklet (mic-worklet.js; ScriptProcessor where there is none) taps it, and every
// 100 ms is sent as base64 PCM16, the protocol's default format. Server VAD cuts the turns.
// Uses $, api and errorText from app.js (classic scripts share one global scope).
"use strict";

const LIVE_RATE = 24000;
const CHUNK = LIVE_RATE / 10; // 100 ms per append

class LiveMic {
  constructor() {
    this.ws = null;
    this.ctx = null;
    this.stream = null;
    this.pending = [];
    this.pendingLen = 0;
    this.turns = new Map(); // item id -> its line on the page
  }

  async start() {
    $("live-error").textContent = "";
    const res = await api("/v1/realtime/client_secrets", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ session: { type: "transcription" } }),
    });
    if (!res.ok) throw new Error(await errorText(res));
    const secret = (await res.json()).value;
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    this.ws = new WebSocket(`${scheme}//${location.host}/v1/realtime?intent=transcription`,
                            ["realtime", "openai-insecure-api-key." + secret]);
    this.ws.addEventListener("message", (e) => this.onEvent(JSON.parse(e.data)));
    this.ws.addEventListener("close", () => this.stop(false));
    await new Promise((resolve, reject) => {
      this.ws.addEventListener("open", resolve, { once: true });
      this.ws.addEventListener("error", () => reject(new Error("the live connection failed")), { once: true });
    });
    const lang = $("opt-language").value.trim();
    const transcription = lang && lang !== "auto" ? { language: lang } : {};
    this.send({ type: "session.update", session: { type: "transcription", audio: { input: {
      format: { type: "audio/pcm", rate: LIVE_RATE }, transcription,
      turn_detection: { type: "server_vad", silence_duration_ms: 500 } } } } });
    await this.tap();
    $("mic").textContent = "Stop microphone";
    $("mic").dataset.live = "on";
  }

  async tap() {
    this.ctx = new AudioContext({ sampleRate: LIVE_RATE });
    const source = this.ctx.createMediaStreamSource(this.stream);
    if (this.ctx.audioWorklet) {
      await this.ctx.audioWorklet.addModule("/web/mic-worklet.js");
      const node = new AudioWorkletNode(this.ctx, "mic-tap");
      node.port.onmessage = (e) => this.push(e.data);
      source.connect(node);
    } else { // older browsers: the deprecated main-thread processor
      const node = this.ctx.createScriptProcessor(4096, 1, 1);
      node.onaudioprocess = (e) => this.push(e.inputBuffer.getChannelData(0).slice(0));
      source.connect(node);
      node.connect(this.ctx.destination);
    }
  }

  push(samples) {
    this.pending.push(samples);
    this.pendingLen += samples.length;
    if (this.pendingLen < CHUNK) return;
    const pcm = new Int16Array(this.pendingLen);
    let at = 0;
    for (const part of this.pending) {
      for (let k = 0; k < part.length; k++) {
        const s = Math.max(-1, Math.min(1, part[k]));
        pcm[at++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      }
    }
    this.pending = [];
    this.pendingLen = 0;
    const bytes = new Uint8Array(pcm.buffer);
    let bin = "";
    for (let k = 0; k < bytes.length; k += 0x8000) {
      bin += String.fromCharCode.apply(null, bytes.subarray(k, k + 0x8000));
    }
    this.send({ type: "input_audio_buffer.append", audio: btoa(bin) });
  }

  send(event) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  turn(itemId) {
    let li = this.turns.get(itemId);
    if (!li) {
      li = document.createElement("li");
      li.className = "live-turn";
      li.dataset.item = itemId;
      const text = document.createElement("span");
      text.className = "text";
      li.append(text);
      $("live-turns").append(li);
      this.turns.set(itemId, li);
    }
    return li;
  }

  onEvent(ev) {
    if (ev.type === "input_audio_buffer.speech_started") {
      this.turn(ev.item_id).classList.add("speaking");
    } else if (ev.type === "conversation.item.input_audio_transcription.delta") {
      const li = this.turn(ev.item_id);
      li.querySelector(".text").textContent += ev.delta; // text, never markup
      li.dataset.deltas = String(Number(li.dataset.deltas || 0) + 1);
    } else if (ev.type === "conversation.item.input_audio_transcription.completed") {
      const li = this.turn(ev.item_id);
      li.querySelector(".text").textContent = ev.transcript;
      li.classList.remove("speaking");
      li.classList.add("final");
    } else if (ev.type === "error") {
      $("live-error").textContent = ev.error.message;
    }
  }

  stop(close = true) {
    if (this.stream) for (const t of this.stream.getTracks()) t.stop();
    if (this.ctx) this.ctx.close();
    this.stream = this.ctx = null;
    // Closing ends the session: the service commits an open turn and keeps the transcript.
    if (close && this.ws) this.ws.close(1000);
    $("mic").textContent = "Start microphone";
    delete $("mic").dataset.live;
  }
}

let liveMic = null;

async function toggleMic() {
  if (liveMic && $("mic").dataset.live) {
    liveMic.stop();
    return;
  }
  liveMic = new LiveMic();
  try {
    await liveMic.start();
  } catch (e) {
    liveMic.stop();
    if (!(e instanceof NeedKey)) $("live-error").textContent = String(e.message || e);
  }
}

document.addEventListener("DOMContentLoaded", () => $("mic").addEventListener("click", toggleMic));
