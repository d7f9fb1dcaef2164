"""ServerConfig: the inference servers stage 0 asks for answers instead of a local teacher."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.redact import display_url, server_secrets


@dataclass(frozen=True)
class ServerConfig:
    """Where answers come from when stage 0 uses inference servers instead of a local teacher."""

    endpoints: tuple[str, ...] = field(metadata={"name": "endpoint", "repeat": True})
    """Base URLs of OpenAI-compatible servers, e.g. http://127.0.0.1:8000/v1 (requests are spread over them)."""
    served_model: str
    """The model name the servers serve it under (the `model` field of each request)."""
    concurrency: int = 8
    """Requests in flight at once, over all endpoints."""
    api_key_env: str | None = None
    """Environment variable holding the API key sent as a bearer token (none when unset)."""
    request_timeout: float = 600.0
    """Seconds one request may take, from sending it to the last byte of the answer, before it is retried."""
    max_retries: int = 5
    """Retries of one request after a transient failure (connection, timeout, 429, 5xx)."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled for each further one, at most 30 s."""

    def __post_init__(self) -> None:
        endpoints = tuple(self.endpoints)
        if not endpoints:
            raise ConfigError("no --endpoint given; pass the base URL of a server, e.g. --endpoint http://127.0.0.1:8000/v1")
        for url in endpoints:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                shown = display_url(url) if isinstance(url, str) else url
                raise ConfigError(f"--endpoint {shown!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/v1")
        object.__setattr__(self, "endpoints", tuple(u.rstrip("/") for u in endpoints))
        if not isinstance(self.served_model, str) or not self.served_model:
            raise ConfigError("--served-model is empty; pass the name the server serves the teacher under")
        for name in ("concurrency", "max_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "concurrency" else 0):
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} must be a whole number "
                                  f"{'>= 1' if name == 'concurrency' else '>= 0'}")
        for name in ("request_timeout", "backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ConfigError(f"--api-key-env {self.api_key_env} names an environment variable that is unset or "
                                  "empty; export the key there first")
            # A header cannot hold them, and httpx's error would quote the whole key ("Illegal
            # header value b'Bearer sk-...\\r'"); the key itself is never printed.
            if not all("!" <= c <= "~" for c in key):
                raise ConfigError(f"the key in ${self.api_key_env} (--api-key-env) holds a space, a control character "
                                  "(a trailing newline or CR from a file?) or a non-ASCII character, which an HTTP "
                                  f"header cannot carry; export it again without them, e.g. "
                                  f"export {self.api_key_env}=\"$(tr -d '\\r\\n ' < keyfile)\"")

    @property
    def secrets(self) -> list[str]:
        """What no message may show: the API key and the passwords in the endpoints."""
        return server_secrets(self.endpoints, self.api_key_env)
