"""The ``batchscribe`` command-line client (cli.py): ``transcribe`` for a few files, ``dataset``
for a manifest (flow control, checkpoint, resume, scoring). Needs httpx and tqdm and the app's
scorer, never the service's engine."""
