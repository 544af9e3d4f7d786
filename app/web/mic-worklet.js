// The microphone's samples off the audio thread: an AudioWorkletProcessor that hands each
// 128-frame render quantum (mono, the AudioContext's rate) to the page, which batches them.
"use strict";

class MicTap extends AudioWorkletProcessor {
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) this.port.postMessage(channel.slice(0));
    return true;
  }
}

registerProcessor("mic-tap", MicTap);
