"""GET /webhooks/secret: the secret that signs the caller's webhook deliveries.

Each API key's deliveries are signed with its own secret (app/jobs/webhooks.py: derived from
the server's ``webhooks.secret`` and the key's id), shown here to that key only: a receiver
verifies with it and rejects deliveries signed for any other key. Without keys it is the
server's secret itself, shown only on loopback (the keyless Host check).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.api.deps import Caller, caller, door
from app.api.errors import ErrorBody
from app.errors import BadRequest
from app.jobs.door import Door

router = APIRouter(tags=["webhooks"])


class WebhookSecret(BaseModel):
    key_id: str | None = Field(description="The API key's id: `key_id` in each delivery's body "
                               "and its X-Batchscribe-Key-Id header (null without keys).")
    secret: str = Field(description="HMAC-SHA256 key of X-Batchscribe-Signature: "
                        "sha256=HEX(HMAC(secret, '{X-Batchscribe-Timestamp}.{body}')).")


@router.get("/webhooks/secret", response_model=WebhookSecret,
            responses={400: {"model": ErrorBody}})
async def webhook_secret(d: Door = Depends(door), who: Caller = Depends(caller)) -> WebhookSecret:
    secret = d.webhook_secret(who.owner)
    if secret is None:
        raise BadRequest("webhooks are off on this service (no webhooks secret configured)")
    return WebhookSecret(key_id=who.owner, secret=secret)
