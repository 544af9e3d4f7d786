"""The realtime family: live transcription over WebSocket, OpenAI's Realtime API with
``intent=transcription``. protocol.py is what the socket speaks before the core takes over;
api_router.py moves the messages.

``GET /v1/realtime?intent=transcription`` (WebSocket): the route only moves messages between
the socket and the core (``Door.live``, app/jobs/live.py, which runs
:class:`app.live.session.LiveSession`). The caller is the key middleware's (app/api/middleware):
an ``Authorization`` header, or a client secret in the ``openai-insecure-api-key.<secret>``
subprotocol or the ``client_secret`` query parameter, for browsers. It is an ordinary FastAPI
WebSocket route, so every ASGI middleware of the app sees its ``websocket`` scope.

``POST /v1/realtime/client_secrets``: a short-lived token for that socket, in the shape of
OpenAI's ephemeral keys (``{value, expires_at, session}``); it opens live sessions only.
"""
