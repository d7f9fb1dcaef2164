"""Caches on object storage: build, info, verify, read, resume, train and eval against a real
S3-compatible server (moto in server mode on 127.0.0.1), through fsspec/s3fs.

Credentials and endpoint come from the standard AWS environment (set for this module only by the
``s3_server`` fixture), once from ``--storage-options`` instead.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from helpers import assert_same_content, cache_content, qa_rows, write_jsonl  # noqa: E402
from s3_server import reset_s3_clients, s3_server  # noqa: E402,F401  (s3_server: module-scoped fixture)
from typer.testing import CliRunner  # noqa: E402

from cli.cache import app as cache_app  # noqa: E402
from cli.train import app as train_app  # noqa: E402
from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import open_cache  # noqa: E402

BUILD_OPTIONS = ["--dtype", "bfloat16", "--layers", "0,2", "--top-k", "8", "--batch-tokens", "512",
                 "--shard-size", "60000", "--chunk-size", "16KiB"]



def _invoke(app, args: list[str], code: int = 0):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code, (args, result.output, result.exception)
    return result


def _records(cache) -> list[dict]:
    return [shard.record for shard in cache.shards]


def _forget_last_shard(client, bucket: str, prefix: str, url: str) -> None:
    """Format 2: drop the last shard's row from rank 0's part of the index, as if the build had
    died before checkpointing it (the part is where a resuming rank starts)."""
    import pyarrow as pa

    from dflash_cache.format import index
    from dflash_cache.format import token_tables as tokens

    if open_cache(url).version == 1:
        return
    key = f"{prefix}/{index.part_paths(0)[index.SHARDS]}"
    table = pa.ipc.open_file(pa.py_buffer(client.get_object(Bucket=bucket, Key=key)["Body"].read())).read_all()
    client.put_object(Bucket=bucket, Key=key, Body=tokens.ipc_bytes(table.slice(0, table.num_rows - 1)))


def _build(teacher: str, data: str, out: str, *extra: str):
    return _invoke(cache_app, ["build", "--teacher", teacher, "--data", data, "--out", out, *BUILD_OPTIONS,
                               "--quiet", *extra])


@pytest.fixture(scope="module")
def built(s3_server, tmp_path_factory, teacher_dir):  # noqa: F811
    """The same corpus built twice with the CLI: to a local folder and to s3://BUCKET/cache."""
    root = tmp_path_factory.mktemp("s3_build")
    data = write_jsonl(root / "chat.jsonl", qa_rows(40, seed=7, prefix="s3-"))
    teacher = teacher_dir("qwen3")
    local = str(root / "local")
    _build(teacher, data, local)
    url = s3_server.url("cache")
    _build(teacher, data, url)
    return {"local": local, "url": url, "data": data, "teacher": teacher}


def test_build_info_verify_and_read_equal_local(s3_server, built):  # noqa: F811
    url, local = built["url"], built["local"]
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="cache/")["Contents"]}
    assert "cache/manifest.json" in keys and "cache/teacher/head.safetensors" in keys
    assert not any("/.tmp-" in k for k in keys)  # nothing left over from the write

    s3_cache, local_cache = open_cache(url), open_cache(local)
    assert s3_cache.complete and len(s3_cache.shards) >= 3
    assert len(s3_cache) == len(local_cache) == 40
    # Same shards cut the same way, with the same files, sizes and checksums.
    assert _records(s3_cache) == _records(local_cache)
    assert s3_cache.manifest["totals"] == local_cache.manifest["totals"]
    for shard in s3_cache.shards:
        folder = fmt.shard_path("cache", shard.name, s3_cache.version)
        assert f"{folder}.json" in keys
        assert {f"{folder}/{f}" for f in shard.record["files"]} <= keys
    assert_same_content(cache_content(url), cache_content(local))
    # Random access by id, the teacher's frozen pieces and the tokenizer come back too.
    np.testing.assert_array_equal(s3_cache["s3-007"].input_ids, local_cache["s3-007"].input_ids)
    assert s3_cache.teacher_config() == local_cache.teacher_config()
    for name, tensor in s3_cache.load_teacher_head().items():
        assert tensor.equal(local_cache.load_teacher_head()[name])
    assert s3_cache.load_tokenizer().get_vocab() == local_cache.load_tokenizer().get_vocab()

    info = _invoke(cache_app, ["info", url]).output
    assert f"cache        {url} (complete)" in info and "sequences    40" in info
    assert json.loads(_invoke(cache_app, ["info", url, "--json"]).output)["index"] == s3_cache.manifest["index"]
    ok = _invoke(cache_app, ["verify", url, "--quiet"]).output
    assert f"ok: {len(s3_cache.shards)} shard(s), 40 sequences verified" in ok


def test_storage_options_instead_of_environment(s3_server, built, monkeypatch):  # noqa: F811
    """The endpoint from --storage-options JSON, with no AWS_ENDPOINT_URL in the environment."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    reset_s3_clients()  # a client made with the env endpoint would be reused
    try:
        options = json.dumps({"endpoint_url": s3_server.endpoint})
        assert "sequences    40" in _invoke(cache_app, ["info", built["url"], "--storage-options", options]).output
        _invoke(cache_app, ["verify", built["url"], "--storage-options", options, "--quiet"])
        s3_content = cache_content(built["url"], {"endpoint_url": s3_server.endpoint})
        assert_same_content(s3_content, cache_content(built["local"]))
    finally:
        reset_s3_clients()


def test_endpoint_and_credentials_from_aws_config_files(s3_server, built, tmp_path, monkeypatch):  # noqa: F811
    """As boto finds them: ~/.aws/config (endpoint_url, region) and ~/.aws/credentials."""
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text(f"[default]\nregion = us-east-1\nendpoint_url = {s3_server.endpoint}\n")
    credentials.write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    reset_s3_clients()
    try:
        assert "sequences    40" in _invoke(cache_app, ["info", built["url"]]).output
        assert len(open_cache(built["url"]).shards[0][0]) > 0  # and the data, through Zarr's own client
    finally:
        reset_s3_clients()


def test_train_and_eval_from_s3(s3_server, built, tmp_path, monkeypatch):  # noqa: F811
    """dflash-train run streams the cache from S3 in a DataLoader worker (endpoint from
    --storage-options only, no AWS_ENDPOINT_URL); dflash-train eval reads it with the
    environment's endpoint."""
    with monkeypatch.context() as mp:
        mp.delenv("AWS_ENDPOINT_URL")
        reset_s3_clients()
        out = tmp_path / "run"
        _invoke(train_app, ["run", "--cache", built["url"], "--out", str(out), "--steps", "3", "--num-layers", "1",
                            "--block-size", "4", "--eval-sequences", "0", "--heldout-fraction", "0.05",
                            "--batch-tokens", "256", "--num-workers", "1", "--quiet",
                            "--storage-options", json.dumps({"endpoint_url": s3_server.endpoint})])
    reset_s3_clients()
    assert (out / "drafter" / "model.safetensors").exists()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "train"][-1] == 3

    report = tmp_path / "eval.json"
    _invoke(train_app, ["eval", "--checkpoint", str(out / "drafter"), "--cache", built["url"],
                        "--heldout-fraction", "0.2", "--max-sequences", "4", "--device", "cpu", "--out", str(report)])
    result = json.loads(report.read_text())
    assert result["offline"]["positions"] > 0 and result["offline"]["tau"] >= 1.0


def test_verify_names_a_corrupted_object(s3_server, built):  # noqa: F811
    """Objects overwritten behind the writer's back (another client, same sizes, so only the
    checksums can tell): verify names each damaged shard and exits 1."""
    cache = open_cache(built["url"])
    damage = {cache.shards[1].name: ("tokens.arrow", "tokens.arrow checksum mismatch"),
              cache.shards[2].name: ("hidden.zarr/c/0/0/0", "hidden states: a chunk's crc32c mismatch")}
    client, originals = s3_server.client(), {}
    try:
        for shard, (name, _) in damage.items():
            key = f"{fmt.shard_path('cache', shard, cache.version)}/{name}"
            originals[key] = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
            damaged = bytearray(originals[key])
            damaged[len(damaged) // 2] ^= 0x5A
            client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(damaged))
        output = _invoke(cache_app, ["verify", built["url"], "--quiet"], code=1).output
        for shard, (_, problem) in damage.items():
            assert f"BAD {shard}: {problem}" in output
        assert output.count("BAD ") == 2
        assert f"error: 2 of {len(cache.shards)} shard(s) are damaged" in output
    finally:
        for key, data in originals.items():
            client.put_object(Bucket=s3_server.bucket, Key=key, Body=data)


def test_resume_after_losing_the_last_commit_record(s3_server, built):  # noqa: F811
    """A crash after a shard's data but before its record: the rerun redoes that shard, and the
    cache ends identical to an uninterrupted build."""
    client, url = s3_server.client(), s3_server.url("resumed")
    for obj in client.list_objects_v2(Bucket=s3_server.bucket, Prefix="cache/")["Contents"]:
        client.copy_object(Bucket=s3_server.bucket, Key="resumed/" + obj["Key"].removeprefix("cache/"),
                           CopySource={"Bucket": s3_server.bucket, "Key": obj["Key"]})
    _invoke(cache_app, ["verify", url, "--quiet"])  # this process now holds a listing of shards/
    before = open_cache(url)
    last = before.shards[-1].name
    folder = fmt.shard_path("resumed", last, before.version)
    # Deleted by another client, so this process's listing caches do not know; and the index as a
    # build killed before it recorded that shard left it (its part without the shard, no merge).
    client.delete_object(Bucket=s3_server.bucket, Key=f"{folder}.json")
    _forget_last_shard(client, s3_server.bucket, "resumed", url)
    # What a writer killed mid-shard leaves in place (no rename on S3): a torn file, a stray chunk.
    client.put_object(Bucket=s3_server.bucket, Key=f"{folder}/tokens.arrow", Body=b"torn")
    client.put_object(Bucket=s3_server.bucket, Key=f"{folder}/hidden.zarr/c/9/0/0", Body=b"junk")

    result = _build(built["teacher"], built["data"], url)
    assert f"resuming: {len(before.shards) - 1} committed shard(s) kept" in result.output
    assert "1 uncommitted shard(s) removed" in result.output
    after = open_cache(url)
    assert after.complete
    assert _records(after) == _records(before) == _records(open_cache(built["local"]))
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{folder}/")["Contents"]}
    assert keys == {f"{folder}/{f}" for f in after.shards[-1].record["files"]}
    assert_same_content(cache_content(url), cache_content(built["local"]))
    _invoke(cache_app, ["verify", url, "--quiet"])


def test_read_ahead_from_s3_is_bounded_and_equal_to_local(s3_server, built):  # noqa: F811
    remote, local = open_cache(built["url"]), open_cache(built["local"])
    refs = [(s, i) for s in range(len(remote.shards)) for i in range(len(remote.shards[s]))][::-1]
    budget = 3 * max(remote.sequence_bytes(*r) for r in refs)
    ahead = remote.read_ahead(refs, max_bytes=budget, threads=4)
    for record, (s, i) in zip(ahead, refs):
        expected = local.shards[s][i]
        assert record.id == expected.id
        np.testing.assert_array_equal(record.hidden.view(np.uint16), expected.hidden.view(np.uint16))
        np.testing.assert_array_equal(record.topk_logprobs, expected.topk_logprobs)
    assert 0 < ahead.peak_bytes <= budget


def test_unreachable_endpoint_and_unknown_option_are_one_line(s3_server, teacher_dir, tmp_path):  # noqa: F811
    reset_s3_clients()
    down = json.dumps({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
                       "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})
    bogus = json.dumps({"endpoint_url": s3_server.endpoint, "no_such_option": 1})
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(2, seed=1, prefix="x-"))
    cases = [
        (cache_app, ["info", s3_server.url("nowhere"), "--storage-options", down]),
        (cache_app, ["verify", s3_server.url("nowhere"), "--storage-options", down]),
        (cache_app, ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--out", s3_server.url("new"),
                     "--layers", "0", "--quiet", "--storage-options", down]),
        (train_app, ["run", "--cache", s3_server.url("nowhere"), "--out", str(tmp_path / "run"), "--storage-options", down]),
        (cache_app, ["info", s3_server.url("nowhere"), "--storage-options", bogus]),
    ]
    for app, args in cases:
        reset_s3_clients()
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, (args, result.output, result.exception)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "the storage cannot be reached" in lines[0] and "--storage-options" in lines[0], \
            (args, result.output)
