"""``python -m tests.fake_replica``: the service's app and lifespan (``create_app``) on its
settings from the environment, served by uvicorn, with the fake engine of tests/fakes.py
instead of Whisper: a real process (killable, its own event loop, its own replica id) for the
tests of what replicas share (tests/test_replica_limits.py), at the cost of Silero's load."""

from __future__ import annotations

if __name__ == "__main__":
    import uvicorn

    from app.config import Settings
    from app.main import create_app, setup_logging
    from tests.fakes import FakeEngine

    setup_logging()
    settings = Settings()
    app = create_app(settings, engine_factory=lambda s: FakeEngine())
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None)
