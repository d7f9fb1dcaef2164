"""Answers from OpenAI-compatible chat servers (vLLM, SGLang, ...): the server backend of stage 0.

A `ChatServers` spreads chat-completion requests over one or more endpoints with a bounded number
in flight, retries what can succeed later (connection refused, timeouts, 429, 5xx) with
exponential backoff, and turns what cannot (an unknown model, a prompt too long for one row) into
a per-row problem. Nothing here knows about part files: `regenerate` owns the resume protocol.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from dflash_common.errors import ConfigError, DFlashError

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class ServerUnavailable(DFlashError):
    """A server kept failing after every retry; nothing of the request was kept."""


class RequestRefused(DFlashError):
    """A server refused a request in a way a retry cannot fix (4xx): a problem of that row."""


@dataclass(frozen=True)
class ServerConfig:
    """Where answers come from when stage 0 uses inference servers instead of a local teacher."""

    endpoints: tuple[str, ...]
    """Base URLs of OpenAI-compatible servers, e.g. http://127.0.0.1:8000/v1 (requests are spread over them)."""
    served_model: str
    """The model name the servers serve it under (the `model` field of each request)."""
    concurrency: int = 8
    """Requests in flight at once, over all endpoints."""
    api_key_env: str | None = None
    """Environment variable holding the API key sent as a bearer token (none when unset)."""
    request_timeout: float = 600.0
    """Seconds one request may take before it is retried."""
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
                raise ConfigError(f"--endpoint {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/v1")
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
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ConfigError(f"--api-key-env {self.api_key_env} names an environment variable that is unset or empty; "
                              "export the key there first")


@dataclass
class Completion:
    """One answer as the server gave it."""

    text: str
    reasoning: str | None
    tokens: int
    finish_reason: str

    @property
    def stopped(self) -> bool:
        """Whether the model ended the answer itself (not cut at max_tokens)."""
        return self.finish_reason == "stop"


def retry_delay(attempt: int, base: float, cap: float = 30.0) -> float:
    """Seconds before retry `attempt` (1-based): base, 2 base, 4 base, ... at most `cap`."""
    return min(cap, base * 2 ** (attempt - 1))


class ChatServers:
    """Chat completions over the configured endpoints, `concurrency` at a time."""

    def __init__(self, cfg: ServerConfig, on_retry: Callable[[str, str], None] = lambda url, error: None):
        import httpx

        self.cfg, self.on_retry = cfg, on_retry
        headers = {"Authorization": f"Bearer {os.environ[cfg.api_key_env]}"} if cfg.api_key_env else {}
        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
        self.clients = [httpx.Client(base_url=url, headers=headers, timeout=cfg.request_timeout, limits=limits)
                        for url in cfg.endpoints]
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.retries = 0

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> "ChatServers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _client(self):
        with self._lock:
            return self.clients[next(self._next) % len(self.clients)]

    def complete(self, body: dict[str, Any]) -> Completion:
        """One request, retried on transient failures (each retry may go to another endpoint)."""
        import httpx

        body = {"model": self.cfg.served_model, **body}
        last = "no attempt"
        url = self.cfg.endpoints[0]
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
                self.on_retry(url, last)
                time.sleep(retry_delay(attempt, self.cfg.backoff_s))
            client = self._client()
            url = str(client.base_url).rstrip("/")
            try:
                response = client.post("/chat/completions", json=body)
            except httpx.TransportError as err:  # refused, reset, timed out
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                continue
            if response.status_code in RETRYABLE_STATUS:
                last = f"HTTP {response.status_code}: {_error_text(response)}"
                continue
            if response.status_code >= 400:
                raise RequestRefused(f"{url} refused the request (HTTP {response.status_code}: {_error_text(response)})")
            return _completion(response.json(), url)
        raise ServerUnavailable(f"{url} kept failing after {self.cfg.max_retries} retries (last: {last[:300]}); "
                                "check the server, then rerun the same command to resume")

    def complete_many(self, bodies: Sequence[dict[str, Any]]) -> list[Completion | RequestRefused]:
        """All requests with `concurrency` in flight; a refused request is returned as its error,
        a server that stays down raises ServerUnavailable once the requests in flight are done."""
        def one(body):
            try:
                return self.complete(body)
            except RequestRefused as err:
                return err

        with ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="dflash-chat") as pool:
            return list(pool.map(one, bodies))

    def model_ids(self) -> list[str]:
        """The models the first endpoint serves (`GET /models`), to refuse a wrong --served-model early."""
        import httpx

        url = self.cfg.endpoints[0]
        try:
            response = self.clients[0].get("/models")
            response.raise_for_status()
            return [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            raise ServerUnavailable(f"{url}/models did not answer ({type(err).__name__}: {err}); start the server or "
                                    "fix --endpoint, then rerun") from None


def _error_text(response) -> str:
    try:
        data = response.json()
        message = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(message, dict):
            message = message.get("message", message)
        return str(message)[:200]
    except ValueError:
        return response.text[:200]


def _completion(data: dict, url: str) -> Completion:
    try:
        choice = data["choices"][0]
        message = choice["message"]
        tokens = int((data.get("usage") or {}).get("completion_tokens", 0))
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return Completion(text=message.get("content") or "", reasoning=reasoning, tokens=tokens,
                          finish_reason=str(choice.get("finish_reason")))
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise RequestRefused(f"{url} answered without choices[0].message ({type(err).__name__}: {err})") from None
