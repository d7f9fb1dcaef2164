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
from dflash_regenerate.chat_server import ChatServers, ServerConfig, ServerUnavailable, retry_delay


class ScriptedServer:
    """POST /v1/chat/completions answers `echo: <last user message>` unless the script says
    otherwise: a list of (status, body) consumed one request at a time, then 200s."""

    def __init__(self, script=(), model="tiny"):
        self.script, self.model, self.requests = list(script), model, []
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
                self._send(200, {"data": [{"id": outer.model}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if outer.script:
                    status, reply = outer.script.pop(0)
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

    def start(script=(), model="tiny"):
        s = ScriptedServer(script, model)
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
                           "notes.txt"}
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
    assert len(healthy.requests) == 6 and [p.name for p in parts.iterdir()] == [".settings.json"]
    # a finished output is kept as well when --overwrite is refused
    (parts / "notes.txt").write_text("keep")
    done = out.read_bytes()
    again = regen(data, out, healthy.url, "--overwrite")
    assert again.exit_code == 1 and "holds 'notes.txt'" in again.output
    assert out.read_bytes() == done and (parts / "notes.txt").read_text() == "keep" and len(healthy.requests) == 6
