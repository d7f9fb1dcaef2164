"""Stage 1 end to end: the cache equals the teacher, survives SIGKILL, refuses mismatches."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
from helpers import assert_same_content, cache_content, chat_rows, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from cli.cache import app
from dflash_build import BuildConfig, build_cache
from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.settings.storage_config import StorageConfig
from dflash_common.errors import CacheError, ConfigError
from dflash_corpus import CorpusConfig
from dflash_teacher.tapped_layers import default_layer_ids
from dflash_teacher.teacher import TeacherConfig, padding_fraction, plan_batches

ROOT = Path(__file__).resolve().parents[1]


def make_config(data, out, teacher, dtype="float32", layers=(0, 1, 2), top_k=8, batch_tokens=256,
                shard_bytes=40_000, **kw) -> BuildConfig:
    return BuildConfig(
        out=str(out), corpus=CorpusConfig(data=str(data)),
        teacher=TeacherConfig(name_or_path=teacher, dtype=dtype, layers=layers, top_k=top_k, batch_tokens=batch_tokens),
        storage=StorageConfig(shard_bytes=shard_bytes), **kw,
    )


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "llama"])
def test_cache_equals_direct_teacher_forward_fp32(tmp_path, teacher_dir, arch):
    teacher = teacher_dir(arch)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    build_cache(make_config(data, tmp_path / "cache", teacher))
    cache = open_cache(str(tmp_path / "cache"))
    assert cache.complete and len(cache) == 12 and cache.layer_ids == [0, 1, 2]
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    for seq_id in ["chat-0000", "chat-0005", "chat-0011"]:
        record = cache[seq_id]
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(record.input_ids.astype(np.int64))[None], output_hidden_states=True)
        for i, layer in enumerate(cache.layer_ids):
            np.testing.assert_allclose(record.hidden[:, i], out.hidden_states[layer + 1][0].numpy(), rtol=1e-5, atol=1e-5)
        logprobs = torch.log_softmax(out.logits[0].float(), -1)
        values, ids = logprobs.topk(8, -1)
        np.testing.assert_allclose(record.topk_logprobs, values.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(record.topk_ids, ids.numpy())


def test_last_decoder_layer_is_refused(tmp_path, teacher_dir):
    """vLLM and SGLang cannot serve the last layer's output, so a cache never holds it."""
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    with pytest.raises(ConfigError, match=r"--layers 1,3: layer 3 is the teacher's last decoder layer.*use layers in 0\.\.2"):
        build_cache(make_config(data, tmp_path / "cache", teacher, layers=(1, 3)))
    assert not (tmp_path / "cache" / "manifest.json").exists()
    result = CliRunner().invoke(app, ["build", "--teacher", teacher, "--data", data, "--out", str(tmp_path / "c2"),
                                            "--layers", "3", "--quiet"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "last decoder layer" in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize("num_layers", [3, 4, 6, 8, 16, 64])
@pytest.mark.parametrize("drafter_layers", [1, 2, 3, 5])
def test_default_layers_never_tap_the_first_or_last_layer(num_layers, drafter_layers):
    layers = default_layer_ids(num_layers, drafter_layers)
    assert layers and len(set(layers)) == len(layers) == min(drafter_layers, num_layers - 2)
    assert 0 not in layers and num_layers - 1 not in layers and all(0 < i < num_layers - 1 for i in layers)
    if (num_layers, drafter_layers) == (64, 5):
        assert layers == [1, 16, 31, 46, 61]


def test_default_layers_of_a_two_layer_teacher_are_refused():
    with pytest.raises(ConfigError, match="2-layer teacher.*pass --layers 0"):
        default_layer_ids(2, 5)


def test_bfloat16_cache_within_rounding_and_lossless_storage(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3", torch.bfloat16)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    build_cache(make_config(data, tmp_path / "cache", teacher, dtype="bfloat16"))
    cache = open_cache(str(tmp_path / "cache"))
    assert cache.hidden_dtype == "bfloat16" and str(cache["chat-0002"].hidden.dtype) == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16).eval()
    record = cache["chat-0002"]
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(record.input_ids.astype(np.int64))[None], output_hidden_states=True)
    direct = out.hidden_states[1][0].float().numpy()
    stored = np.asarray(record.hidden[:, 0], np.float32)
    # bf16 keeps 8 bits of mantissa: values agree within a few units of bf16 rounding
    np.testing.assert_allclose(stored, direct, rtol=2 ** -6, atol=2 ** -6)


def test_bfloat16_storage_is_lossless(tmp_path):
    """Every bf16 bit pattern written is read back unchanged."""
    from dflash_cache import format as fmt
    from dflash_cache.writer import ShardData, write_shard

    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.standard_normal((37, 2, 16)).astype(np.float32) * 100).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    shard = ShardData(rank=0, index=0, row_start=0, row_end=2, ids=["a", "b"], rows=np.array([0, 1]),
                      lengths=np.array([30, 7], np.int32), truncated=np.zeros(2, bool),
                      input_ids=np.arange(37, dtype=np.int32), loss_mask=np.ones(37, np.uint8), hidden=bits,
                      topk_ids=np.zeros((37, 3), np.int32), topk_logprobs=np.zeros((37, 3), np.float32))
    store = fmt.CacheStore.open(str(tmp_path))
    record = write_shard(store, shard, StorageConfig(chunk_bytes=256), "bfloat16")
    fmt.write_manifest(store, fmt.manifest_header([0, 1], 16, "bfloat16", 3), [record], complete=False)
    cache = open_cache(str(tmp_path))
    read = np.concatenate([np.asarray(cache[i].hidden) for i in ("a", "b")])
    assert read.dtype.name == "bfloat16"
    np.testing.assert_array_equal(read.view(np.uint16), bits)
    assert record["chunk_tokens"] == 4  # 256-byte chunks of 2 x 16 bf16 values


def test_bucketing_and_padding_change_nothing(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    build_cache(make_config(data, tmp_path / "one_at_a_time", teacher, batch_tokens=1))
    build_cache(make_config(data, tmp_path / "padded", teacher, batch_tokens=100_000))
    a, b = cache_content(tmp_path / "one_at_a_time"), cache_content(tmp_path / "padded")
    assert list(a) == list(b)
    for key in a:
        for x, y in zip(a[key], b[key]):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    manifest = open_cache(str(tmp_path / "padded")).manifest
    assert manifest["last_run"]["padding_fraction"] > 0


@pytest.mark.parametrize("in_flight", [2, 3])
def test_shards_in_flight_change_nothing_but_the_order_of_work(tmp_path, teacher_dir, monkeypatch, in_flight):
    """An engine in another process (vLLM: 2) gets the next shards before the build takes a
    shard's outputs; the shards, their cut and their bytes are those of one shard at a time, and
    they commit in order."""
    from dflash_build.teacher_pass import TeacherPass
    from dflash_teacher.teacher import Teacher

    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    build_cache(make_config(data, tmp_path / "one", teacher, shard_bytes=20_000))
    events = []
    start = TeacherPass.start

    def spied(self, group):
        assert len(group) == 1  # the transformers engine: one shard per generate group
        events.append(("submitted", group[0].index))
        finish = start(self, group)

        def taken():
            events.append(("taken", group[0].index))
            return finish()
        return taken

    monkeypatch.setattr(Teacher, "shards_in_flight", in_flight)
    monkeypatch.setattr(TeacherPass, "start", spied)
    build_cache(make_config(data, tmp_path / "pipelined", teacher, shard_bytes=20_000))
    records = [[(s.record["name"], s.record["rows"]) for s in open_cache(str(tmp_path / name)).shards]
               for name in ("one", "pipelined")]
    assert records[0] == records[1]
    shards = len(records[0])
    assert shards >= 4
    for k in range(shards - in_flight + 1):  # shard k's outputs are taken once k + in_flight - 1 is submitted
        assert events.index(("submitted", k + in_flight - 1)) < events.index(("taken", k)), events
    assert [e for e in events if e[0] == "taken"] == [("taken", k) for k in range(shards)]
    assert_same_content(cache_content(tmp_path / "one"), cache_content(tmp_path / "pipelined"))


def test_plan_batches_respects_budget_and_covers_all():
    lengths = np.array([5, 50, 7, 48, 3, 3, 100, 20])
    batches = plan_batches(lengths, 100)
    assert sorted(np.concatenate(batches).tolist()) == list(range(8))
    for b in batches:
        assert len(b) == 1 or lengths[b].max() * len(b) <= 100
    assert padding_fraction(lengths, batches) < padding_fraction(lengths, [np.arange(8)])


def test_shards_are_cut_by_size_and_listed_with_checksums(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(20))
    manifest = build_cache(make_config(data, tmp_path / "cache", teacher, shard_bytes=30_000))
    assert manifest["complete"] and len(manifest["shards"]) > 2
    assert [s["name"] for s in manifest["shards"]] == [f"shard-r00000-{i:06d}" for i in range(len(manifest["shards"]))]
    assert manifest["shards"][0]["rows"][0] == 0 and manifest["shards"][-1]["rows"][1] == 20
    for s in manifest["shards"]:
        assert set(s["checksums"]) == {"hidden", "tokens.arrow", "sequences.arrow"} and s["bytes"] > 0
    for key in ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype", "corpus", "build"):
        assert key in manifest
    assert manifest["teacher"]["weights_hash"] and manifest["tokenizer"]["chat_template_hash"]
    teacher_files = os.listdir(tmp_path / "cache" / "teacher")
    assert "head.safetensors" in teacher_files and "config.json" in teacher_files
    head = open_cache(str(tmp_path / "cache")).load_teacher_head()
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    assert torch.equal(head["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(head["embed_tokens.weight"], model.model.embed_tokens.weight)
    assert len(open_cache(str(tmp_path / "cache")).load_tokenizer()) == len(AutoTokenizer.from_pretrained(teacher))


def test_rerun_resumes_and_mismatch_is_refused(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    out = tmp_path / "cache"
    build_cache(make_config(data, out, teacher))
    before = cache_content(out)
    build_cache(make_config(data, out, teacher))  # nothing left to do
    assert_same_content(before, cache_content(out))
    with pytest.raises(CacheError, match="top_k differs.*--overwrite"):
        build_cache(make_config(data, out, teacher, top_k=4))
    with pytest.raises(CacheError, match="layer_ids differs"):
        build_cache(make_config(data, out, teacher, layers=(1, 2)))
    build_cache(make_config(data, out, teacher, top_k=4, overwrite=True))
    assert open_cache(str(out)).top_k == 4


def test_nonfinite_teacher_outputs_are_not_written(tmp_path, teacher_dir):
    """A real teacher whose embedding row for one token is NaN poisons every sequence using it."""
    src = teacher_dir("qwen3")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src)
    rows = chat_rows(6)
    used = {i for r in rows for i in tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]}
    # a vocabulary entry no other row uses, that tokenizes back to itself when appended
    poison, word = next((i, tokenizer.decode([i])) for i in range(len(tokenizer) - 1, 0, -1)
                        if i not in used and tokenizer(tokenizer.decode([i]))["input_ids"] == [i])
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    bad_teacher = tmp_path / "nan_teacher"
    model.save_pretrained(bad_teacher)
    tokenizer.save_pretrained(bad_teacher)
    rows[2]["messages"][-1]["content"] += word
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    manifest = build_cache(make_config(data, tmp_path / "cache", str(bad_teacher)))
    cache = open_cache(str(tmp_path / "cache"))
    assert "chat-0002" not in cache and len(cache) == 5
    assert manifest["totals"]["skipped"] == {"nonfinite": 1}


def _records(out: Path) -> list[Path]:
    return sorted((out / "shards").glob("r*/shard-*.json"))


@pytest.mark.slow
def test_sigkill_during_build_then_rerun_equals_clean_build(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(120, seed=3))
    args = ["build", "--teacher", teacher, "--data", data, "--dtype", "float32", "--layers", "0,1,2",
            "--top-k", "8", "--batch-tokens", "64", "--shard-size", "12kB", "--quiet"]
    clean = tmp_path / "clean"
    assert CliRunner().invoke(app, args + ["--out", str(clean)]).exit_code == 0
    total_shards = len(_records(clean))
    assert total_shards >= 8

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "cli.cache", *args, "--out", str(killed)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(_records(killed)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(_records(killed))
    assert 3 <= committed < total_shards, "the kill must land mid-build"

    # a partial cache is readable and shows only committed shards, all intact
    partial = open_cache(str(killed))
    assert not partial.complete and len(partial.shards) <= committed
    assert CliRunner().invoke(app, ["verify", str(killed), "--quiet"]).exit_code == 0

    result = CliRunner().invoke(app, args + ["--out", str(killed)])
    assert result.exit_code == 0, result.output
    assert open_cache(str(killed)).complete
    assert_same_content(cache_content(clean), cache_content(killed))
    assert not list((killed / "shards" / "r00000").glob(".tmp/*"))  # the rank's work folder holds no leftover


def test_cli_build_info_verify_and_corruption(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30))
    out = tmp_path / "cache"
    runner = CliRunner()
    base = ["build", "--teacher", teacher, "--data", data, "--out", str(out), "--dtype", "float32",
            "--layers", "0,2", "--top-k", "4", "--shard-size", "20kB", "--quiet"]
    dry = runner.invoke(app, base + ["--dry-run"])
    assert dry.exit_code == 0 and "sequences 30" in dry.output and not out.exists()
    assert runner.invoke(app, base).exit_code == 0
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0 and "sequences    30" in info.output and "layers       0,2" in info.output
    # the capture health the writer recorded, a line per tapped layer, no flag on a sound teacher
    health = [line for line in info.output.splitlines() if line.startswith("layer ") and ": RMS " in line]
    assert [line.split(":")[0] for line in health] == ["layer 0", "layer 2"] and "FLAG" not in info.output, info.output
    assert all(float(line.split("RMS ")[1].split(",")[0]) > 0 for line in health)
    tokens = open_cache(str(out)).num_tokens
    assert f"tokens {tokens:,}" in dry.output
    assert runner.invoke(app, ["verify", str(out), "--quiet"]).exit_code == 0

    shards = sorted(p for p in (out / "shards" / "r00000").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(shards) >= 3
    with open(shards[0] / "tokens.arrow", "r+b") as f:  # truncate
        f.truncate(100)
    chunk = next(p for p in (shards[1] / "hidden.zarr").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # flip a byte
    chunk.write_bytes(bytes(raw))
    import shutil

    shutil.rmtree(shards[2])  # delete a shard folder
    result = runner.invoke(app, ["verify", str(out), "--quiet"])
    assert result.exit_code == 1
    for shard, problem in [(shards[0], "tokens.arrow is 100 bytes"), (shards[1], "crc32c mismatch"),
                           (shards[2], "shard folder missing")]:
        assert f"BAD {shard.name}: " in result.output and problem in result.output


def test_console_scripts_installed():
    import shutil

    assert shutil.which("dflash-cache") or Path(sys.executable).with_name("dflash-cache").exists()
    out = subprocess.run([str(Path(sys.executable).with_name("dflash-cache")), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "build" in out.stdout


def test_bad_rows_fail_with_one_line_or_are_skipped_and_counted(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    good = chat_rows(4)
    lines = [json.dumps(good[0]), "{not json", json.dumps({"id": "x1", "messages": []}),
             json.dumps({"id": "x2", "messages": [{"role": "wizard", "content": "hi"}]}),
             json.dumps(good[1]), json.dumps({"id": "x3"}), json.dumps(good[2])]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "caf\xe9"}\n' + json.dumps(good[3]).encode() + b"\n")
    runner = CliRunner()
    args = ["build", "--teacher", teacher, "--data", str(path), "--dtype", "float32", "--layers", "0,2",
            "--top-k", "4", "--quiet"]
    failed = runner.invoke(app, args + ["--out", str(tmp_path / "fail")])
    assert failed.exit_code == 1
    message = failed.output.strip()
    assert "\n" not in message and "bad.jsonl row 2" in message and "invalid JSON" in message and "--on-bad-row skip" in message
    assert "Traceback" not in failed.output
    skipped = runner.invoke(app, args + ["--out", str(tmp_path / "skip"), "--on-bad-row", "skip"])
    assert skipped.exit_code == 0, skipped.output
    cache = open_cache(str(tmp_path / "skip"))
    assert len(cache) == 4 and cache.manifest["totals"]["skipped"] == {"bad_row": 5}


def test_device_map_loading_gives_the_same_cache(tmp_path, teacher_dir):
    """--device-map goes through transformers' dispatch (on CPU here: every layer on the CPU)."""
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(5))
    build_cache(make_config(data, tmp_path / "plain", teacher))
    cfg = make_config(data, tmp_path / "mapped", teacher)
    import dataclasses

    build_cache(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, device_map="cpu")))
    assert_same_content(cache_content(tmp_path / "plain"), cache_content(tmp_path / "mapped"))


def test_live_manifest_rewrites_stay_linear_for_large_builds(tmp_path, monkeypatch):
    """A single-process build rewrites manifest.json after each commit only while it is small;
    beyond that, only when the rewrites stay under ~1% of the time. The final write lists all."""
    from dflash_build import commit
    from dflash_cache import format as fmt

    assert commit.manifest_due(999, 0.0, 10.0) and not commit.manifest_due(1000, 99.0, 1.0)
    assert commit.manifest_due(10**5, 100.0, 1.0) and commit.manifest_due(10**5, 0.5, 0.004)

    monkeypatch.setattr(commit, "LIVE_MANIFEST_SHARDS", 3)
    keeper = commit.ManifestKeeper(fmt.CacheStore.open(str(tmp_path)), {"format": fmt.FORMAT_NAME, "format_version": 1}, [], live=True)

    def shard(i: int) -> dict:
        return {"name": f"shard-r00000-{i:06d}", "sequences": 1, "tokens": 5, "loss_tokens": 4, "bytes": 100}

    def listed() -> int:
        return len(json.loads((tmp_path / fmt.MANIFEST).read_text())["shards"])

    keeper.commit(shard(0))
    keeper.commit(shard(1))
    assert listed() == 2  # small: every commit
    keeper.last_write_s = 3600.0  # as if the last rewrite had taken an hour
    keeper.commit(shard(2))
    keeper.commit(shard(3))
    assert listed() == 2 and len(keeper.records) == 4
    final = keeper.write(complete=True)
    assert listed() == 4 and final["complete"] and final["totals"]["bytes"] == keeper.bytes == 400


def test_output_folder_checks_refuse_foreign_files_but_not_a_rank_writing_the_manifest(tmp_path):
    """A folder of other files is refused; a manifest that another rank of the same build renames
    into place between this rank's checks is not mistaken for one (a torchrun start-up race)."""
    from fsspec.implementations.local import LocalFileSystem

    from dflash_build import output
    from dflash_cache import format as fmt

    header = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a cache")
    with pytest.raises(CacheError, match="non-empty folder without a dflash manifest"):
        output.prepare_output(fmt.CacheStore.open(str(foreign)), header, overwrite=False)

    class OtherRankWritesFirst(LocalFileSystem):
        """The real local filesystem; the first look for the manifest misses the rank that is
        renaming it into place (with its teacher files) at that moment."""

        raced = False

        def exists(self, path, **kwargs):
            found = super().exists(path, **kwargs)
            if path.endswith(fmt.MANIFEST) and not self.raced:
                self.raced = True
                fmt.write_json_atomic(self, path, header)
                self.makedirs(path.rsplit("/", 1)[0] + "/" + fmt.TEACHER_DIR, exist_ok=True)
            return found

    racing = tmp_path / "racing"
    racing.mkdir()
    fs = OtherRankWritesFirst(skip_instance_cache=True)
    output.prepare_output(fmt.CacheStore(fs, str(racing), str(racing)), header, overwrite=False)
    assert fs.raced and (racing / fmt.MANIFEST).exists()


def test_v2_manifest_is_small_and_index_holds_every_sequence(tmp_path, teacher_dir):
    """Format 2 with tiny chunks: manifest.json names no shard or chunk file; the index tables
    give every sequence's length without opening a shard; a shard has a constant number of files."""
    from dflash_cache import format as fmt

    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(20))
    out = tmp_path / "cache"
    build_cache(dataclasses.replace(make_config(data, out, teacher), storage=StorageConfig(shard_bytes=30_000, chunk_bytes=256)))
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    assert manifest["format_version"] == 2 and "shards" not in manifest and "hidden.zarr" not in json.dumps(manifest)
    assert (out / fmt.MANIFEST).stat().st_size < 8000
    cache = open_cache(str(out))
    table = cache.sequence_table()
    assert table.num_rows == len(cache) == 20 and int(table.column("length").to_numpy().sum()) == cache.num_tokens
    for j, shard in enumerate(cache.shards):
        files = [p for p in (out / "shards" / "r00000" / shard.name).rglob("*") if p.is_file()]
        assert len(files) <= 4 and shard.record["chunk_tokens"] < shard.record["tokens"] or shard.record["tokens"] <= 1
        assert list(shard.lengths) == list(table.filter(pc.equal(table.column("shard"), j)).column("length").to_numpy())


def test_zeroed_embeddings_stop_the_build_with_one_line(tmp_path, teacher_dir):
    """A real teacher whose input embeddings are zero writes all-zero hidden states: the build stops
    before committing the shard, with the typed one-line error naming the layer."""
    from dflash_cache.health import CaptureError

    src = teacher_dir("qwen3")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    zeroed = tmp_path / "zeroed"
    model.save_pretrained(zeroed)
    AutoTokenizer.from_pretrained(src).save_pretrained(zeroed)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    with pytest.raises(CaptureError, match="tapped layer 0 is all zeros") as err:
        build_cache(make_config(data, tmp_path / "cache", str(zeroed)))
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "cache" / "shards").glob("r*/shard-*.json"))


def test_info_on_an_edited_manifest_is_not_a_traceback(tmp_path, teacher_dir):
    """#36: totals.bytes as a string, a teacher without a name: info still prints, no traceback;
    #60: and exits 1, naming a malformed field in one line."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    out = tmp_path / "cache"
    build_cache(make_config(data, out, teacher_dir("qwen3")))
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    manifest["totals"]["bytes"] = "lots"
    del manifest["teacher"]["name"]
    (out / fmt.MANIFEST).write_text(json.dumps(manifest))
    result = CliRunner().invoke(app, ["info", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output and "teacher      ?" in result.output
    assert "manifest.json field" in result.output.strip().splitlines()[-1]


def test_cross_check_records_differences_and_stops_past_the_bound(tmp_path, teacher_dir):
    """--cross-check N recomputes N sequences unpadded with the transformers engine; a build whose
    outputs are not the reference teacher's stops with one line."""
    from types import SimpleNamespace

    from dflash_build.cross_check import CrossCheck
    from dflash_common.errors import TeacherError
    from dflash_teacher.teacher import load_teacher

    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    manifest = build_cache(make_config(data, tmp_path / "cache", teacher, cross_check=3))
    check = manifest["last_run"]["cross_check"]
    assert check["sequences"] == 3 and check["tokens"] > 0 and check["top1_agreement"] == 1.0
    assert set(check["hidden_relative"]) == {"0", "1", "2"}
    assert max(check["hidden_relative"].values()) < 1e-5 and check["logprobs_relative"] < 1e-5
    with pytest.raises(ConfigError, match="--cross-check -1"):
        make_config(data, tmp_path / "c2", teacher, cross_check=-1)

    # the cache's sequences against another teacher (the llama one): far past any bound
    cache = open_cache(str(tmp_path / "cache"))
    records = [cache[i] for i in ["chat-0001", "chat-0004"]]
    shard = SimpleNamespace(
        ids=["chat-0001", "chat-0004"], lengths=np.array([len(r.input_ids) for r in records]),
        input_ids=np.concatenate([r.input_ids for r in records]),
        hidden=np.concatenate([r.hidden for r in records]).astype(np.float32),
        topk_ids=np.concatenate([r.topk_ids for r in records]),
        topk_logprobs=np.concatenate([r.topk_logprobs for r in records]))
    other = load_teacher(TeacherConfig(name_or_path=teacher_dir("llama"), dtype="float32", layers=(0, 1, 2), top_k=8))
    with pytest.raises(TeacherError, match=r"cross-check: sequence 'chat-000[14]' .* past --cross-check-bound 0.05") as err:
        CrossCheck(5, 0.05, lambda: other, [0, 1, 2]).check_shard(0, shard)
    assert "\n" not in str(err.value)


def test_cross_check_fails_a_tap_off_by_one_layer_among_massive_activations(teacher_dir):
    """Issue 42: the difference was scaled by the layer's largest magnitude, so with Qwen's massive
    activations (a few channels of the first token in the thousands, nearly the same in
    neighbouring layers) a tap off by one layer passed the 0.05 bound. The relative norm per
    position fails it, while the same states rounded to bf16 (an engine's honest difference) pass."""
    from types import SimpleNamespace

    from dflash_build.cross_check import CrossCheck, sequence_differences
    from dflash_common.errors import TeacherError
    from dflash_teacher.teacher import load_teacher

    teacher = load_teacher(TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32", layers=(0, 1, 2), top_k=8))
    ids = np.asarray(teacher.tokenizer("The cache stores each tapped layer's states, and the drafter reads "
                                       "them back at every position of the sequence.")["input_ids"])
    out = teacher.forward([ids])
    states, logprobs = out.hidden.astype(np.float32), out.topk_logprobs
    massive = states.copy()
    massive[0, :, 7] += np.array([2400.0, 2410.0, 2405.0])  # the first token's massive channels, layer by layer
    massive[0, :, 40] -= np.array([1800.0, 1795.0, 1801.0])
    off_by_one = massive[:, [1, 2, 1]]  # each tap holds its neighbour layer's states
    bf16 = (massive.view(np.uint32) >> 16).astype(np.uint16)  # what a bf16 build stores, truncated
    bound = 0.05
    honest, _ = sequence_differences(bf16, logprobs, massive, logprobs)
    shifted, _ = sequence_differences(off_by_one, logprobs, massive, logprobs)
    assert max(honest) < bound / 5, honest
    assert min(shifted) > 2 * bound, shifted

    # through the build's check: a shard whose taps are the neighbour layers' stops the build
    shard = SimpleNamespace(ids=["s"], lengths=np.array([len(ids)]), input_ids=ids, hidden=states[:, [1, 2, 1]],
                            topk_ids=out.topk_ids, topk_logprobs=logprobs)
    with pytest.raises(TeacherError, match=r"layer \d's hidden states differ by .* \(relative norm\) .* past --cross-check-bound"):
        CrossCheck(1, bound, lambda: teacher, [0, 1, 2]).check_shard(0, shard)
    exact = SimpleNamespace(**{**vars(shard), "hidden": states})
    CrossCheck(1, bound, lambda: teacher, [0, 1, 2]).check_shard(0, exact)


def test_transformers_engine_names_its_gated_deltanet_implementation(tmp_path, teacher_dir):
    """A qwen3_5 teacher's build says whether its Gated DeltaNet layers run the kernels or the torch
    fallback (here: the fallback, neither package installed), and warns for the fallback on CUDA."""
    from dflash_teacher.deltanet_kernels import gated_deltanet_note
    from dflash_teacher.teacher import load_teacher

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))
    out = CliRunner().invoke(app, ["build", "--teacher", teacher_dir("qwen3_5"), "--data", data, "--out",
                                   str(tmp_path / "cache"), "--dtype", "float32", "--layers", "0,1,2", "--quiet"])
    assert out.exit_code == 0, out.output
    fallback = "teacher: Gated DeltaNet layers run transformers' torch fallback (flash-linear-attention, causal-conv1d not installed)"
    assert fallback in out.output
    hybrid = load_teacher(TeacherConfig(name_or_path=teacher_dir("qwen3_5"), dtype="float32", layers=(0, 1, 2)))
    assert hybrid.notes == [fallback]
    warning = gated_deltanet_note(hybrid.model, torch.device("cuda"))
    assert warning.startswith("warning: " + fallback) and "pip install flash-linear-attention causal-conv1d" in warning
    plain = load_teacher(TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32", layers=(0, 1, 2)))
    assert plain.notes == [] and gated_deltanet_note(plain.model, torch.device("cuda")) is None


def test_cross_check_of_two_ranks_is_merged_into_the_manifest(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    assert build_cache(make_config(data, tmp_path / "cache", teacher, rank=0, world_size=2, cross_check=2))["complete"] is False
    manifest = build_cache(make_config(data, tmp_path / "cache", teacher, rank=1, world_size=2, cross_check=2))
    check = manifest["last_run"]["cross_check"]
    assert manifest["complete"] and check["sequences"] == 4 and check["top1_agreement"] == 1.0, check
    assert max(check["hidden_relative"].values()) < 1e-5, check
