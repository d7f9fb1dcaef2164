"""Stage 0 through OpenAI-compatible servers: retries, refusals and resume, on real HTTP.

Faults are injected with a small real HTTP server on 127.0.0.1 that answers chat completions
from a script (500s, 400s, a stop). The happy path against the real vLLM server is in
tests/test_serving.py (marked `serving`).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import write_jsonl
from typer.testing import CliRunner

from cli.cache import app
from dflash_regenerate.chat_server import ChatServers, ServerUnavailable, retry_delay
from dflash_regenerate.settings.server_config import ServerConfig


class ScriptedServer:
    """POST /v1/chat/completions answers `echo: <last user message>` unless the script says
    otherwise: a list of (status, body) consumed one request at a time, then 200s. A callable
    body writes the reply itself (raw bytes, a drip, a redirect): body(handler, request)."""

    def __init__(self, script=(), model="tiny", models=None):
        self.script, self.model, self.requests = list(script), model, []
        self.models = models if models is not None else {"data": [{"id": model}]}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if callable(outer.models):
                    return outer.models(self, None)
                self._send(200, outer.models)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if outer.script:
                    status, reply = outer.script.pop(0)
                    if callable(reply):
                        return reply(self, body)
                    if status != 200:
                        return self._send(status, reply)
                user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
                self._send(200, {"choices": [{"message": {"role": "assistant",
                                                          "content": "" if "empty" in user else f"echo: {user}",
                                                          "reasoning_content": "thinking"},
                                              "finish_reason": "length" if "long" in user else "stop"}],
                                 "usage": {"completion_tokens": 3}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers = []

    def start(script=(), model="tiny", models=None):
        s = ScriptedServer(script, model, models)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def rows(n):
    return [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": "old"}]} for i in range(n)]


def regen(data, out, url, *extra):
    return CliRunner().invoke(app, ["regenerate", "--endpoint", url, "--served-model", "tiny", "--data", str(data),
                                    "--out", str(out), "--rows-per-part", "2", "--quiet", *extra])


def test_retry_delays_double_up_to_a_cap():
    assert [retry_delay(a, 0.5, cap=3) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3, 3]


def test_500_twice_then_200_is_retried_and_succeeds(tmp_path, server):
    s = server([(500, {"error": "overloaded"}), (503, {"error": "busy"})])
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    result = regen(data, tmp_path / "out.jsonl", s.url, "--concurrency", "1")
    assert result.exit_code == 0, result.output
    assert len(s.requests) == 3  # two failures, one success
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert written[0]["messages"][-1] == {"role": "assistant", "content": "echo: question 0"}
    assert s.requests[-1]["model"] == "tiny" and s.requests[-1]["temperature"] == 0.0


def test_a_server_that_stays_down_stops_with_one_line_and_the_rerun_resumes(tmp_path, server):
    data = write_jsonl(tmp_path / "in.jsonl", rows(6))
    out = tmp_path / "out.jsonl"
    # part 0 (rows 0-1) answers; then every request fails until the retries run out
    s = server([(200, None), (200, None)] + [(502, {"error": "bad gateway"})] * 20)
    result = regen(data, out, s.url, "--concurrency", "1", "--max-retries", "2")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and s.url in lines[-1] and "HTTP 502" in lines[-1] and "rerun" in lines[-1]
    assert not out.exists() and (tmp_path / "out.parts" / ".part-000000.json").exists()
    assert not (tmp_path / "out.parts" / ".part-000001.json").exists()
    s.stop()
    # the rerun against a healthy server keeps part 0 and finishes
    healthy = server()
    result = regen(data, out, healthy.url)
    assert result.exit_code == 0, result.output
    assert len(healthy.requests) == 4  # rows 2-5 only
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == [f"r{i}" for i in range(6)]


def test_connection_refused_names_the_url(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    result = regen(data, tmp_path / "out.jsonl", "http://127.0.0.1:9/v1")
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert "http://127.0.0.1:9/v1" in line and "start the server or fix --endpoint" in line


def test_a_refused_request_is_a_bad_row_and_truncation_is_counted(tmp_path, server):
    s = server([(400, {"error": {"message": "This model's maximum context length is 64 tokens"}})])
    data = write_jsonl(tmp_path / "in.jsonl", rows(3) + [{"id": "r3", "messages": [{"role": "user", "content": "a long one"}]}])
    out = tmp_path / "out.jsonl"
    failed = regen(data, out, s.url, "--concurrency", "1")
    assert failed.exit_code == 1 and "maximum context length" in failed.output and "row 1" in failed.output
    s.script = [(400, {"error": {"message": "This model's maximum context length is 64 tokens"}})]
    skipped = regen(data, out, s.url, "--concurrency", "1", "--on-bad-row", "skip", "--overwrite",
                    "--on-truncated", "drop")
    assert skipped.exit_code == 0, skipped.output
    written = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert written == ["r1", "r2"]  # r0 refused (skipped), r3 cut at max tokens (dropped)
    assert "bad_row: 1" in skipped.output and "truncated: 1" in skipped.output


def test_reasoning_is_kept_only_when_asked_and_settings_are_recorded(tmp_path, server):
    s = server()
    data = write_jsonl(tmp_path / "in.jsonl", rows(2))
    out = tmp_path / "out.jsonl"
    assert regen(data, out, s.url, "--reasoning", "keep").exit_code == 0
    message = json.loads(out.read_text().splitlines()[0])["messages"][-1]
    assert message == {"role": "assistant", "content": "echo: question 0", "reasoning_content": "thinking"}
    settings = json.loads((tmp_path / "out.parts" / ".settings.json").read_text())
    assert settings["backend"] == "server" and settings["teacher_name"] == "tiny" and settings["reasoning"] == "keep"
    refused = regen(data, out, s.url, "--reasoning", "drop")
    assert refused.exit_code == 1 and "reasoning differs" in refused.output


def test_wrong_served_model_is_refused_before_any_request(tmp_path, server):
    s = server(model="other")
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    result = regen(data, tmp_path / "out.jsonl", s.url)
    assert result.exit_code == 1 and "--served-model 'tiny' is not served" in result.output and "other" in result.output
    assert s.requests == []


def test_requests_are_spread_over_endpoints(server):
    a, b = server(), server()
    cfg = ServerConfig(endpoints=(a.url, b.url), served_model="tiny", concurrency=2)
    with ChatServers(cfg) as servers:
        answers = servers.complete_many([{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(6)])
    assert [x.text for x in answers] == [f"echo: q{i}" for i in range(6)]
    assert len(a.requests) == 3 and len(b.requests) == 3


def test_server_unavailable_after_retries(server):
    s = server([(429, {"error": "slow down"})] * 3)
    cfg = ServerConfig(endpoints=(s.url,), served_model="tiny", max_retries=2, backoff_s=0.01)
    with ChatServers(cfg) as servers, pytest.raises(ServerUnavailable, match="HTTP 429"):
        servers.complete({"messages": [{"role": "user", "content": "q"}]})
    assert len(s.requests) == 3


def test_bad_server_options_are_one_line(tmp_path, teacher_dir):
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    for args, expected in ((["--endpoint", "127.0.0.1:8000"], "not an http(s) URL"),
                           (["--endpoint", "http://127.0.0.1:9/v1", "--concurrency", "0"], "--concurrency 0"),
                           (["--endpoint", "http://127.0.0.1:9/v1", "--api-key-env", "DFLASH_NO_SUCH_KEY"], "unset or empty")):
        result = CliRunner().invoke(app, ["regenerate", "--served-model", "tiny", "--data", str(data),
                                          "--out", str(tmp_path / "o.jsonl"), "--quiet", *args])
        assert result.exit_code == 1 and expected in result.output, result.output
    both = CliRunner().invoke(app, ["regenerate", "--teacher", teacher_dir("qwen3"), "--endpoint", "http://127.0.0.1:9/v1",
                                    "--data", str(data), "--out", str(tmp_path / "o.jsonl")])
    assert both.exit_code == 1 and "not both or neither" in both.output
    no_model = CliRunner().invoke(app, ["regenerate", "--endpoint", "http://127.0.0.1:9/v1", "--data", str(data),
                                        "--out", str(tmp_path / "o.jsonl")])
    assert no_model.exit_code == 1 and "--endpoint needs --served-model" in no_model.output
    assert not Path(tmp_path / "o.jsonl").exists()


def test_an_empty_answer_is_counted_and_can_be_dropped(tmp_path, server):
    s = server()
    data = write_jsonl(tmp_path / "in.jsonl", rows(2) + [{"id": "r2", "messages": [{"role": "user", "content": "empty please"}]}])
    kept = regen(data, tmp_path / "kept.jsonl", s.url)
    assert kept.exit_code == 0 and "1 empty answer(s)" in kept.output, kept.output
    assert len((tmp_path / "kept.jsonl").read_text().splitlines()) == 3
    dropped = regen(data, tmp_path / "dropped.jsonl", s.url, "--on-truncated", "drop")
    assert dropped.exit_code == 0 and "empty: 1" in dropped.output, dropped.output
    assert [json.loads(line)["id"] for line in (tmp_path / "dropped.jsonl").read_text().splitlines()] == ["r0", "r1"]


def test_overwrite_deletes_only_what_regenerate_wrote(tmp_path, server):
    data = write_jsonl(tmp_path / "in.jsonl", rows(6))
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.parts"
    # a run stopped after part 0 (its settings, part and commit record), a killed write's temporary, a user's notes
    down = server([(200, None), (200, None)] + [(502, {"error": "bad gateway"})] * 20)
    assert regen(data, out, down.url, "--concurrency", "1", "--max-retries", "1").exit_code == 1
    (parts / ".part-000001.jsonl.tmp-1a2b3c4d").write_text("half a part")
    (parts / "notes.txt").write_text("rows 3 and 5 look odd")
    before = {p.name: p.read_bytes() for p in parts.iterdir()}
    assert set(before) == {".settings.json", "part-000000.jsonl", ".part-000000.json", ".part-000001.jsonl.tmp-1a2b3c4d",
                           "notes.txt", ".dflash.lock"}  # the lock stays: deleting a held one would admit a second writer
    healthy = server()
    refused = regen(data, out, healthy.url, "--overwrite")
    assert refused.exit_code == 1
    assert refused.output.strip().splitlines() == [
        f"error: {parts} holds 'notes.txt', which regenerate did not write; --overwrite deletes only the parts and "
        f"settings it wrote, so nothing was deleted: move them out of {parts} and rerun"]
    assert {p.name: p.read_bytes() for p in parts.iterdir()} == before and healthy.requests == []

    # moved out, the same command starts over: every row is asked again, and only the settings stay
    (parts / "notes.txt").unlink()
    assert regen(data, out, healthy.url, "--overwrite").exit_code == 0
    assert len(healthy.requests) == 6 and sorted(p.name for p in parts.iterdir()) == [".dflash.lock", ".settings.json"]
    # a finished output is kept as well when --overwrite is refused
    (parts / "notes.txt").write_text("keep")
    done = out.read_bytes()
    again = regen(data, out, healthy.url, "--overwrite")
    assert again.exit_code == 1 and "holds 'notes.txt'" in again.output
    assert out.read_bytes() == done and (parts / "notes.txt").read_text() == "keep" and len(healthy.requests) == 6


# --- secrets, refusals that stop the command, hangs and replies of the wrong shape (issue 25) ---

KEY = "sk-live-7f3a9c1e5b"
PASSWORD = "hunter2-pw-81c4"


def _raw(status, data: bytes, headers=()):
    """A scripted reply written as given: any status, any body, any headers."""
    def reply(handler, request):
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    return reply


def _echo_authorization(status):
    """A server (or proxy) whose error quotes the request's credentials back."""
    def reply(handler, request):
        data = json.dumps({"error": {"message": f"invalid credentials {handler.headers.get('Authorization')} "
                                                f"for user:{PASSWORD}"}}).encode()
        _raw(status, data, [("Content-Type", "application/json")])(handler, request)
    return reply


def _one_line(result):
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def _with_password(url):
    return url.replace("http://", f"http://user:{PASSWORD}@")


def test_a_key_with_a_control_character_is_refused_without_printing_it(tmp_path, server, monkeypatch):
    s = server()
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    for bad in (f"{KEY}\r", f"{KEY}\n", f"{KEY} x", f"{KEY}\u00e9"):
        monkeypatch.setenv("DFLASH_TEST_KEY", bad)
        line = _one_line(regen(data, tmp_path / "out.jsonl", s.url, "--api-key-env", "DFLASH_TEST_KEY"))
        assert "$DFLASH_TEST_KEY" in line and "control character" in line and KEY not in line, line
    assert s.requests == [] and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("status,expected", [(401, "refused the API key; check --api-key-env"),
                                             (403, "refused the API key; check --api-key-env"),
                                             (404, "check --endpoint")])
def test_auth_and_wrong_url_stop_the_command_and_no_secret_is_printed(tmp_path, server, monkeypatch, status, expected):
    """401/403/404 fail every row alike: with --on-bad-row skip they wrote 0 rows and exited 0."""
    monkeypatch.setenv("DFLASH_TEST_KEY", KEY)
    s = server([(status, _echo_authorization(status))] * 4)
    data = write_jsonl(tmp_path / "in.jsonl", rows(3))
    out = tmp_path / "out.jsonl"
    result = regen(data, out, _with_password(s.url), "--api-key-env", "DFLASH_TEST_KEY", "--on-bad-row", "skip",
                   "--concurrency", "1")
    line = _one_line(result)
    assert f"HTTP {status}" in line and expected in line and "127.0.0.1" in line, line
    assert KEY not in result.output and PASSWORD not in result.output and "***" in line, line
    assert not out.exists() and not list((tmp_path / "out.parts").glob("part-*"))


def test_no_credential_is_printed_when_the_server_cannot_be_reached(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_KEY", KEY)
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    result = regen(data, tmp_path / "out.jsonl", f"http://user:{PASSWORD}@127.0.0.1:9/v1", "--api-key-env",
                   "DFLASH_TEST_KEY")
    line = _one_line(result)
    assert "127.0.0.1:9/v1" in line and PASSWORD not in result.output and KEY not in result.output, line


def test_retry_messages_hide_what_the_server_echoes(server, monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_KEY", KEY)
    s = server([(503, _echo_authorization(503))] * 2)
    seen = []
    cfg = ServerConfig(endpoints=(_with_password(s.url),), served_model="tiny", api_key_env="DFLASH_TEST_KEY",
                       max_retries=1, backoff_s=0.01)
    with ChatServers(cfg, on_retry=lambda url, error: seen.append(f"{url} {error}")) as servers, \
            pytest.raises(ServerUnavailable) as raised:
        servers.complete({"messages": [{"role": "user", "content": "q"}]})
    text = " ".join(seen) + str(raised.value)
    assert "invalid credentials" in text and KEY not in text and PASSWORD not in text


@pytest.mark.parametrize("status,reply,expected", [
    (302, _raw(302, json.dumps({"choices": [{"message": {"content": "a login page"}, "finish_reason": "stop"}]}).encode(),
               [("Location", f"http://user:{PASSWORD}@127.0.0.1:1/login"), ("Content-Type", "application/json")]),
     "HTTP 302, a redirect to http://***@127.0.0.1:1/login, not an answer"),
    (307, _raw(307, b""), "HTTP 307, a redirect"),
    (200, _raw(200, b"<html>Welcome to nginx</html>", [("Content-Type", "text/html")]), "with a body that is not JSON"),
    (501, _raw(501, b"not implemented"), "HTTP 501 (not implemented), which a retry cannot fix"),
])
def test_redirects_and_replies_that_are_no_chat_server_stop_the_command(tmp_path, server, status, reply, expected):
    """A redirect's body was kept as the answer; a 200 web page was a traceback."""
    s = server([(status, reply)] * 4)
    data = write_jsonl(tmp_path / "in.jsonl", rows(2))
    out = tmp_path / "out.jsonl"
    line = _one_line(regen(data, out, s.url, "--on-bad-row", "skip", "--concurrency", "1"))
    assert expected in line and PASSWORD not in line, line
    assert not out.exists() and len(s.requests) == 1


@pytest.mark.parametrize("message,usage,expected", [
    ({"content": ["a", "list"]}, {"completion_tokens": 3}, "message.content a JSON list, not a string"),
    ({"content": "ok"}, "3 tokens", "usage a JSON str, not an object"),
    ({"content": "ok"}, {"completion_tokens": "3"}, "usage.completion_tokens '3', not a count"),
    ("hello", {"completion_tokens": 3}, "without choices[0].message"),
    ({"content": "a\ud800b"}, {"completion_tokens": 3}, "with an answer that holds a lone surrogate '\\ud800'"),
])
def test_an_answer_of_the_wrong_shape_is_a_bad_row(tmp_path, server, message, usage, expected):
    reply = json.dumps({"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage}).encode()
    s = server([(200, _raw(200, reply, [("Content-Type", "application/json")]))])
    data = write_jsonl(tmp_path / "in.jsonl", rows(2))
    line = _one_line(regen(data, tmp_path / "out.jsonl", s.url, "--concurrency", "1"))
    assert "row 1" in line and expected in line, line
    skipped = regen(data, tmp_path / "skip.jsonl", s.url, "--concurrency", "1", "--on-bad-row", "skip")
    assert skipped.exit_code == 0, skipped.output  # the script is spent: r1 is answered, r0 was refused
    s.script = [(200, _raw(200, reply, [("Content-Type", "application/json")]))]
    skipped = regen(data, tmp_path / "skip2.jsonl", s.url, "--concurrency", "1", "--on-bad-row", "skip")
    assert skipped.exit_code == 0 and "bad_row: 1" in skipped.output, skipped.output
    assert [json.loads(x)["id"] for x in (tmp_path / "skip2.jsonl").read_text().splitlines()] == ["r1"]


@pytest.mark.parametrize("models,expected", [
    (_raw(200, b'[{"id": "tiny"}]'), "answered with a JSON list, not an OpenAI model list"),
    (_raw(200, b'{"data": "tiny"}'), "not an OpenAI model list"),
    (_raw(200, b"<html>"), "with a body that is not JSON"),
    (_raw(401, b'{"error": "no key"}'), "HTTP 401 (no key): it refused the API key"),
])
def test_a_model_list_of_the_wrong_shape_is_one_line(tmp_path, server, models, expected):
    s = server(models=models)
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    line = _one_line(regen(data, tmp_path / "out.jsonl", s.url))
    assert f"{s.url}/models" in line and expected in line, line
    assert s.requests == []


def test_request_timeout_is_a_deadline_for_the_whole_answer(tmp_path, server):
    """A server dripping a byte a second never trips a per-read timeout (it took 44 s for 2)."""
    import time

    def drip(handler, request):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        try:
            for _ in range(30):
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    s = server([(200, drip)])
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    started = time.monotonic()
    line = _one_line(regen(data, tmp_path / "out.jsonl", s.url, "--request-timeout", "2", "--max-retries", "0"))
    assert time.monotonic() - started < 8
    assert "no whole answer within --request-timeout 2 s" in line and "kept failing after 0 retries" in line, line


def test_an_answer_larger_than_the_cap_is_not_read_and_is_a_bad_row(tmp_path, server):
    from dflash_regenerate.chat_server import answer_byte_limit

    huge = json.dumps({"choices": [{"message": {"content": "x" * (answer_byte_limit(16) + 10)},
                                    "finish_reason": "stop"}]}).encode()
    s = server([(200, _raw(200, huge, [("Content-Type", "application/json")]))])
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    line = _one_line(regen(data, tmp_path / "out.jsonl", s.url, "--max-new-tokens", "16"))
    assert "row 1" in line and f"an answer larger than {answer_byte_limit(16):,} bytes" in line, line


def test_request_timeout_also_bounds_a_status_line_dripped_byte_by_byte(tmp_path, server):
    """httpx's timeout is per read: headers dripped a byte at a time never trip it."""
    import time

    def drip_headers(handler, request):
        try:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" * 4:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    s = server([(200, drip_headers)])
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    started = time.monotonic()
    line = _one_line(regen(data, tmp_path / "out.jsonl", s.url, "--request-timeout", "2", "--max-retries", "0"))
    assert time.monotonic() - started < 8
    assert "no whole answer within --request-timeout 2 s" in line, line
