"""The dashboard's CSRF guard and signed flash messages: the standard library only (hmac,
secrets), no session store.

A signed double-submit token. A browser gets a random nonce in an HttpOnly, SameSite=Strict cookie;
each form carries HMAC(secret, nonce) in a hidden field. A POST is accepted only when the field
matches the cookie's nonce under the secret. Another site can make the browser post, but cannot
read the page to learn the field, nor (with the signature) plant a cookie of its choosing that a
field of its own would match. The secret is random per process unless given (several processes
serving one dashboard must share it)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

COOKIE = "leasework_csrf"
FLASH_COOKIE = "leasework_flash"
FIELD = "csrf"
_NONCE = re.compile(r"^[A-Za-z0-9_-]{43}$")  # 32 random bytes, urlsafe base64 without padding


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def as_secret(value: str | bytes | None) -> bytes:
    """A configured secret (text or bytes, at least 16 of them), else a fresh random one."""
    if value is None:
        return new_secret()
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) < 16:
        raise ValueError("the dashboard's CSRF secret must be at least 16 bytes long")
    return raw


def new_nonce() -> str:
    return secrets.token_urlsafe(32)


def valid_nonce(value: str | None) -> bool:
    return value is not None and _NONCE.match(value) is not None


def _mac(secret: bytes, purpose: str, value: str) -> str:
    digest = hmac.new(secret, f"{purpose}\x00{value}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def token_for(secret: bytes, nonce: str) -> str:
    """The form field for the browser holding `nonce`."""
    return _mac(secret, "csrf", nonce)


def check(secret: bytes, nonce: str | None, token: str | None) -> bool:
    """True when `token` (the form's field) was made for `nonce` (the cookie) under `secret`."""
    if not valid_nonce(nonce) or not token or len(token) > 100:
        return False
    assert nonce is not None
    return hmac.compare_digest(token.encode(), token_for(secret, nonce).encode())


def sign(secret: bytes, text: str) -> str:
    """A cookie value carrying `text`, which `unsign` gives back only if we wrote it."""
    body = base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()
    return f"{body}.{_mac(secret, 'flash', body)}"


def unsign(secret: bytes, value: str | None) -> str | None:
    if not value or len(value) > 2000 or "." not in value:
        return None
    body, _, mac = value.rpartition(".")
    if not hmac.compare_digest(mac.encode(), _mac(secret, "flash", body).encode()):
        return None
    try:
        return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None
