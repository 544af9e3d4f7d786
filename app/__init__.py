"""batchscribe: batched Whisper transcription over HTTP."""
