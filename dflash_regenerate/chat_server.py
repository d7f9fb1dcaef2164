"""Answers from OpenAI-compatible chat servers (vLLM, SGLang, ...): the server backend of stage 0.

A `ChatServers` spreads chat-completion requests over one or more endpoints with a bounded number
in flight, retries what can succeed later (connection refused, timeouts, 429, 5xx) with
exponential backoff, and turns what cannot (an unknown model, a prompt too long for one row) into
a per-row problem. Nothing here knows about part files: `regenerate` owns the resume protocol.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from dflash_common.errors import DFlashError
from dflash_common.redact import display_url, redact
from dflash_common.values import text_problem
from dflash_regenerate.settings.server_config import ServerConfig

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# Statuses that say every request will fail the same way (the key, the URL or the model is
# wrong): they stop the command; counted as bad rows, --on-bad-row skip would write 0 rows.
FATAL_STATUS = {401: "refused the API key; check --api-key-env (or the credentials in --endpoint)",
                403: "refused the API key; check --api-key-env (or the credentials in --endpoint)",
                404: "has no /chat/completions or does not serve the model; check --endpoint (it ends in /v1, "
                     "e.g. http://127.0.0.1:8000/v1) and --served-model"}
# An error reply is read only this far: its message is cut to 200 characters anyway.
ERROR_BODY_BYTES = 64 << 10
MODELS_BODY_BYTES = 8 << 20


def answer_byte_limit(max_tokens: int) -> int:
    """The most bytes read of one answer: 1 MiB for the reply's envelope plus 256 bytes per
    token (a token is a few characters; JSON escapes at most 6 bytes each; reasoning and
    answer share max_tokens). Far above any real answer, far below what exhausts memory."""
    return (1 << 20) + 256 * int(max_tokens)


class ServerUnavailable(DFlashError):
    """A server kept failing after every retry; nothing of the request was kept."""


class ServerRefused(DFlashError):
    """A server answered in a way that every request would get (a wrong key, URL or model, a
    redirect, a reply that is not JSON): the command stops."""


class RequestRefused(DFlashError):
    """A server refused a request in a way a retry cannot fix (4xx): a problem of that row."""


class _Retry(Exception):
    """A transient failure of one attempt; its text is the `last:` of the final error."""




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


class _Deadline:
    """Cuts a request's connection when its time is up: httpx bounds each read, so a server
    dripping its status line or headers a byte at a time would otherwise hold the request for
    ever. `trace` (an httpx trace extension) learns the request's socket as it connects."""

    def __init__(self, seconds: float):
        self.fired, self.sockets = False, []
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            sock = info["return_value"].get_extra_info("socket")
            if sock is not None:
                self.sockets.append(sock)

    def _fire(self) -> None:
        import socket

        self.fired = True
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns, httpx raises a ReadError
            except OSError:
                pass

    def __enter__(self) -> "_Deadline":
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()


class ChatServers:
    """Chat completions over the configured endpoints, `concurrency` at a time."""

    def __init__(self, cfg: ServerConfig, on_retry: Callable[[str, str], None] = lambda url, error: None):
        import httpx

        self.cfg, self.on_retry = cfg, on_retry
        self.secrets = cfg.secrets
        headers = {"Authorization": f"Bearer {os.environ[cfg.api_key_env]}"} if cfg.api_key_env else {}
        # No keep-alive: each request opens its own connection, so _attempt can cut exactly that
        # one at its deadline (a reused connection is not visible to it). A connect costs far less
        # than an answer.
        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=0)
        # httpx's timeout bounds each read, not the request (a server dripping a byte a second
        # never trips it); _attempt adds the per-request deadline. Redirects are not followed: a
        # redirect's body is not an answer (follow_redirects=False is httpx's default, kept explicit).
        self.clients = [httpx.Client(base_url=url, headers=headers, timeout=cfg.request_timeout, limits=limits,
                                     follow_redirects=False) for url in cfg.endpoints]
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

    @property
    def _expired(self) -> str:
        return f"no whole answer within --request-timeout {self.cfg.request_timeout:g} s"

    def _redact(self, text: str) -> str:
        return redact(text, self.secrets)

    def _shown(self, client) -> str:
        """The client's endpoint as messages show it (no credentials)."""
        return display_url(str(client.base_url).rstrip("/"))

    def _read(self, response, url: str, deadline: float, limit: int, what: str | None) -> bytes:
        """The body, read until `deadline` (time.monotonic) and at most `limit` bytes (decoded,
        so a compressed bomb is bounded too); beyond `limit` it is refused as `what`, or cut
        there when `what` is None (an error reply, of which only the start is shown)."""
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > limit and what is None:
                chunks.append(chunk[:limit - size])
                break
            if size > limit:
                raise RequestRefused(f"{url} sent {what} larger than {limit:,} bytes, which was not "
                                     f"read further; lower --max-new-tokens or check the server")
            if time.monotonic() > deadline:
                raise _Retry(self._expired)
            chunks.append(chunk)
        return b"".join(chunks)

    def _attempt(self, client, body: dict[str, Any]) -> Completion:
        """One request; raises _Retry (transient), RequestRefused (this row) or ServerRefused (every row)."""
        import httpx

        url = self._shown(client)
        deadline = time.monotonic() + self.cfg.request_timeout
        limit = answer_byte_limit(body.get("max_tokens") or 0)
        with _Deadline(self.cfg.request_timeout) as watchdog:
            try:
                return self._exchange(client, body, url, deadline, limit, watchdog.trace)
            except httpx.TransportError as err:  # refused, reset, timed out, or cut at the deadline
                if watchdog.fired:
                    raise _Retry(self._expired) from None
                raise _Retry(self._redact(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)) from None

    def _exchange(self, client, body: dict[str, Any], url: str, deadline: float, limit: int, trace) -> Completion:
        """_attempt's request and the reading of its reply."""
        with client.stream("POST", "/chat/completions", json=body, extensions={"trace": trace}) as response:
            status = response.status_code
            if 200 <= status < 300:
                data = self._read(response, url, deadline, limit, "an answer")
            else:
                error = _error_text(self._read(response, url, deadline, ERROR_BODY_BYTES, None))
                location = response.headers.get("location", "")
        if 200 <= status < 300:
            return _completion(data, url, self._redact)
        error = self._redact(error)
        if status in RETRYABLE_STATUS:
            raise _Retry(f"HTTP {status}: {error}")
        if status in FATAL_STATUS:
            raise ServerRefused(f"{url} answered HTTP {status} ({error}): it {FATAL_STATUS[status]}")
        if 400 <= status < 500:
            raise RequestRefused(f"{url} refused the request (HTTP {status}: {error})")
        if 300 <= status < 400:
            raise ServerRefused(f"{url} answered HTTP {status}, a redirect{' to ' + display_url(location) if location else ''}, "
                                "not an answer (redirects are not followed); pass the URL the server answers at as --endpoint")
        raise ServerRefused(f"{url} answered HTTP {status} ({error}), which a retry cannot fix; check the server")

    def complete(self, body: dict[str, Any]) -> Completion:
        """One request, retried on transient failures (each retry may go to another endpoint)."""
        body = {"model": self.cfg.served_model, **body}
        last = "no attempt"
        url = display_url(self.cfg.endpoints[0])
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
                self.on_retry(url, last)
                time.sleep(retry_delay(attempt, self.cfg.backoff_s))
            client = self._client()
            url = self._shown(client)
            try:
                return self._attempt(client, body)
            except _Retry as err:
                last = str(err)
        raise ServerUnavailable(f"{url} kept failing after {self.cfg.max_retries} retries (last: {last[:300]}); "
                                "check the server, then rerun the same command to resume")

    def complete_many(self, bodies: Sequence[dict[str, Any]]) -> list[Completion | RequestRefused]:
        """All requests with `concurrency` in flight; a refused request is returned as its error;
        a server that stays down (ServerUnavailable) or refuses every request (ServerRefused)
        raises once the requests in flight are done, sending no more."""
        halt = threading.Event()

        def one(body):
            if halt.is_set():  # the command is stopping: send nothing more
                return None
            try:
                return self.complete(body)
            except RequestRefused as err:
                return err
            except BaseException:
                halt.set()
                raise

        with ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="dflash-chat") as pool:
            futures = [pool.submit(one, body) for body in bodies]
            try:
                return [future.result() for future in futures]
            except BaseException:
                # the command stops: requests not yet sent are not sent
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def model_ids(self) -> list[str]:
        """The models the first endpoint serves (`GET /models`), to refuse a wrong --served-model early."""
        import httpx

        client = self.clients[0]
        url = self._shown(client)
        try:
            with client.stream("GET", "/models") as response:
                body = self._read(response, url, time.monotonic() + self.cfg.request_timeout, MODELS_BODY_BYTES,
                                  "a model list")
                status = response.status_code
        except (httpx.HTTPError, RequestRefused, _Retry) as err:
            raise ServerUnavailable(self._redact(f"{url}/models did not answer ({type(err).__name__}: {err}); start the "
                                                 "server or fix --endpoint, then rerun")) from None
        if status in FATAL_STATUS:
            raise ServerRefused(f"{url}/models answered HTTP {status} ({self._redact(_error_text(body))}): it "
                                f"{FATAL_STATUS[status]}")
        if status != 200:
            raise ServerUnavailable(f"{url}/models answered HTTP {status} ({self._redact(_error_text(body))}); start the "
                                    "server or fix --endpoint (redirects are not followed), then rerun")
        data = _json(body)
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
            raise ServerRefused(f"{url}/models answered {_shape(data)}, not an OpenAI model list "
                                '({"data": [{"id": ...}, ...]}); check that --endpoint is an OpenAI-compatible server')
        return [m["id"] for m in models]


_NOT_JSON = object()


def _json(body: bytes) -> Any:
    """The parsed body, or _NOT_JSON (invalid JSON, not UTF-8, or nested too deep to parse)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _shape(data: Any) -> str:
    return "with a body that is not JSON" if data is _NOT_JSON else f"with a JSON {type(data).__name__}"


def _error_text(body: bytes) -> str:
    data = _json(body)
    if data is _NOT_JSON:
        return body[:200].decode("utf-8", "replace")
    message = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message)[:200]


def _completion(body: bytes, url: str, redact_text: Callable[[str], str]) -> Completion:
    """The answer in a 200 reply. A body that is not JSON at all means the endpoint is no chat
    server (a web page, a proxy's notice): every row would fail, so the command stops. A JSON
    reply of the wrong shape is that row's problem."""
    data = _json(body)
    if data is _NOT_JSON:
        raise ServerRefused(f"{url} answered HTTP 200 {_shape(data)} ({redact_text(body[:80].decode('utf-8', 'replace'))!r}"
                            "...), not a chat completion; check that --endpoint is an OpenAI-compatible server")
    problem = None
    choices = data.get("choices") if isinstance(data, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        problem = f"without choices[0].message (it answered {_shape(data)})"
    else:
        usage = data.get("usage")
        tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        text, finish = message.get("content"), choice.get("finish_reason")
        if usage is not None and not isinstance(usage, dict):
            problem = f"with usage a JSON {type(usage).__name__}, not an object"
        elif isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            problem = f"with usage.completion_tokens {tokens!r}, not a count"
        elif text is not None and not isinstance(text, str):
            problem = f"with message.content a JSON {type(text).__name__}, not a string"
        elif reasoning is not None and not isinstance(reasoning, str):
            problem = f"with message.reasoning_content a JSON {type(reasoning).__name__}, not a string"
        elif finish is not None and not isinstance(finish, str):
            problem = f"with finish_reason a JSON {type(finish).__name__}, not a string"
        elif text_problem(text or "") or text_problem(reasoning or ""):  # a JSON escape; no UTF-8 file can hold it
            problem = f"with an answer that {text_problem(text or '') or text_problem(reasoning or '')}"
    if problem:
        raise RequestRefused(redact_text(f"{url} answered {problem}"))
    return Completion(text=text or "", reasoning=reasoning, tokens=tokens, finish_reason=str(finish))
