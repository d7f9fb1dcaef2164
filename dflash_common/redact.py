"""Keeping secrets out of what dflash prints or writes: the one place that says how an API key or
the credentials in a URL are hidden. Every message that quotes a server's reply, an exception of
an HTTP client or a URL goes through `redact` (cli.common.run applies it to every error line as
a last guard)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

HIDDEN = "***"

# scheme://user:password@host or scheme://token@host anywhere in a text (an echoed URL, an
# exception quoting one): the userinfo is replaced, the rest is kept so the URL stays recognisable.
# The scheme's length is bounded: with `*`, every letter of a long run of letters started a scan
# to the run's end, and a 10 MB error line took hours (quadratic) before it was printed.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]{0,31}://)[^/\s@'\"<>]+@")
# "Authorization: Bearer sk-..." / "bearer sk-..." echoed by a server or a proxy.
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\",}]+")


def display_url(url: str) -> str:
    """`url` without its user name and password, for messages (http://***@host:8000/v1)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=f"{HIDDEN}@{parts.netloc.rsplit('@', 1)[1]}"))


def url_secrets(url: str) -> list[str]:
    """The password in a URL (or a lone token, https://TOKEN@host), as a secret to hide wherever
    it appears; a user name beside a password is no secret (and often a common word)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    secret = parts.password if parts.password else parts.username
    return [secret] if secret else []


def server_secrets(urls: Iterable[str] = (), key_env: str | None = None) -> list[str]:
    """What no message may show of a command's servers: the API key held by the environment
    variable ``key_env`` and the passwords in ``urls``."""
    key = os.environ.get(key_env, "") if key_env else ""
    return [key, *(secret for url in urls for secret in url_secrets(url))]


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every secret, URL credential and bearer token replaced by ***."""
    text = str(text)
    # longest first, so a secret that contains another is hidden whole
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    if "://" in text:
        text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{HIDDEN}@", text)
    return _BEARER.sub(lambda m: f"{m.group(1)}{HIDDEN}", text)
