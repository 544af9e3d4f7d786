"""A job's result, one home for its every shape: assembled from its windows' results
(``transcript``), described for the API (``shapes``), and rendered for each API family:
text and subtitles (``formats``: text, srt, vtt, tsv), OpenAI's JSON (``openai``) and
whisper-asr-webservice's (``asr``). Pure functions of the result dict: nothing here runs a
model or touches the job store."""
