"""Thin HTTP routers: parse, authorize, hand over to the core through its door
(app/jobs/door.py), render. Every ASGI middleware is in ``middleware``."""
