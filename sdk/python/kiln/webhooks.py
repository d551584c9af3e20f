"""Verifying Kiln's lifecycle webhook deliveries (docs/webhooks.md): Standard Webhooks signatures, HMAC-SHA256
over ``<event id>.<timestamp>.<raw body>``, sent as ``x-service-signature: v1,<base64> [v1,<base64>…]``."""

import base64
import hashlib
import hmac
import time

from .errors import KilnError

PREFIX = "whsec_"


def _key(secret):
    if secret.startswith(PREFIX):
        return base64.b64decode(secret[len(PREFIX):], validate=True)
    return secret.encode("utf-8")


def _header(headers, name):
    for k, v in headers.items():
        if k.lower() == name:
            return v
    return None


def sign(secret, event_id, timestamp, body):
    """The ``v1,<base64>`` signature of one delivery (what the server sends; useful in tests)."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    mac = hmac.new(_key(secret), b"%s.%d." % (event_id.encode("utf-8"), int(timestamp)) + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode("ascii")


def verify(secret, headers, body, tolerance_s=300, now=None):
    """Checks a delivery's signature and timestamp; returns the event id, or raises KilnError(``invalid_signature``).

    ``headers`` is any mapping of the request's headers (names in any case), ``body`` the raw bytes as received.
    A timestamp more than ``tolerance_s`` away from now is refused (a replay). During a secret rotation the
    header carries several signatures: any one that matches is enough.
    """
    event_id = _header(headers, "x-service-event-id") or _header(headers, "webhook-id")
    timestamp = _header(headers, "x-service-timestamp") or _header(headers, "webhook-timestamp")
    signatures = _header(headers, "x-service-signature") or _header(headers, "webhook-signature")
    if not event_id or not timestamp or not signatures:
        raise KilnError("the delivery lacks its event id, timestamp or signature header", "invalid_signature")
    try:
        ts = int(timestamp)
    except ValueError:
        raise KilnError("the delivery's timestamp is not a number", "invalid_signature") from None
    now = time.time() if now is None else now
    if abs(now - ts) > tolerance_s:
        raise KilnError("the delivery's timestamp is %d s away from now" % abs(now - ts), "invalid_signature")
    expected = sign(secret, event_id, ts, body).encode("ascii")
    for candidate in signatures.split(" "):
        if hmac.compare_digest(candidate.strip().encode("ascii", "replace"), expected):
            return event_id
    raise KilnError("no signature of the delivery matches the secret", "invalid_signature")
