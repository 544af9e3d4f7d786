"""Benchmarks of issue 3: service vs sequential faster-whisper vs the offline engine limit."""
