"""fp8 e4m3 storage of hidden states: the quantiser's properties, and a real build that reads back
within fp8's error of the same lossless build, at half the bytes, and trains."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import qa_rows, replace_shard_records, write_jsonl
from s3_server import s3_server  # noqa: F401  (module-scoped fixture, used by the object-storage test)
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_build import BuildConfig, build_cache
from dflash_cache import open_cache
from dflash_cache.format import fp8
from dflash_cache.settings.storage_config import StorageConfig
from dflash_cache.verify import scale_problems
from dflash_common.errors import CacheError, ConfigError
from dflash_corpus import CorpusConfig
from dflash_teacher.teacher import TeacherConfig

LAYERS = (0, 1, 2)



def _hidden(seed: int = 0, tokens: int = 50, layers: int = 3, size: int = 64) -> np.ndarray:
    """bf16 values with row magnitudes spread over many binades and a few outlier features."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, layers, size)) * np.exp2(rng.integers(-20, 20, (tokens, layers, 1)))
    x[:, :, 3] *= 30
    return x.astype(np.float32).astype(ml_dtypes.bfloat16)


def _error_bound(x: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """Half a unit in the last place of e4m3 at each value: 2^-4 of it in the normal range, and a
    fixed 2^-10 * scale below 2^-6 * scale (subnormals)."""
    return np.maximum(np.abs(x) * 2.0 ** -4, np.exp2(exponents.astype(np.float64) - 10)[..., None])


def test_quantize_rounds_once_to_e4m3_with_the_smallest_power_of_two_scale():
    x = _hidden()
    codes, exponents = fp8.quantize(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and exponents.dtype == np.int8 and exponents.shape == x.shape[:2]
    xf = x.astype(np.float64)
    amax = np.abs(xf).max(-1)
    # smallest k with amax / 2^k <= 448: the row's largest value lands in e4m3's top binade
    scale = np.exp2(exponents.astype(np.float64))
    assert np.all(amax / scale <= 448) and np.all(amax / (scale / 2) > 448)
    # the codes are ml_dtypes' round-to-nearest-even of the exactly scaled values
    reference = np.ldexp(x.astype(np.float32), -exponents[..., None].astype(np.int32)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(codes, reference.view(np.uint8))
    decoded = fp8.dequantize(codes, exponents, "float32").astype(np.float64)
    assert np.all(np.abs(decoded - xf) <= _error_bound(xf, exponents))
    errors = fp8.relative_error(decoded, xf)
    assert errors.shape == (3,) and np.all(errors <= 2 ** -4)
    # many values of one magnitude: rounding to 3 mantissa bits costs ~2.6% of the norm
    gaussian = np.random.default_rng(5).standard_normal((400, 2, 128)).astype(np.float32)
    typical = fp8.relative_error(fp8.dequantize(*fp8.quantize(gaussian), "float32"), gaussian)
    assert np.all((0.02 < typical) & (typical < 0.03)), typical


def test_float32_input_quantizes_like_its_bfloat16_rounding_would_not():
    """float32 hidden states are scaled and rounded once, not through bfloat16 first."""
    x = _hidden(seed=3).astype(np.float32) * np.float32(1 + 2 ** -12)  # bits bf16 cannot hold
    codes, exponents = fp8.quantize(x)
    reference = np.ldexp(x, -exponents[..., None].astype(np.int32)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(codes, reference.view(np.uint8))


def test_bfloat16_decode_is_exact_for_every_code_and_exponent():
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & fp8.NAN_MASK) != fp8.NAN_MASK]  # the two NaN codes
    exponents = np.array([fp8.MIN_EXP, -60, -1, 0, 1, 77, fp8.MAX_EXP], dtype=np.int8)
    grid = np.broadcast_to(codes, (len(exponents), len(codes))).copy()
    as_bf16 = fp8.dequantize(grid, exponents, "bfloat16")
    as_f32 = fp8.dequantize(grid, exponents, "float32")
    exact = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)[None] * np.exp2(exponents.astype(np.float64))[:, None]
    assert as_bf16.dtype == ml_dtypes.bfloat16 and np.all(np.isfinite(as_bf16.astype(np.float32)))
    np.testing.assert_array_equal(as_bf16.astype(np.float64), exact)
    np.testing.assert_array_equal(as_f32.astype(np.float64), exact)


def test_zero_rows_and_extreme_magnitudes():
    x = np.zeros((4, 2, 16), np.float32)
    x[0, 1] = -0.0
    x[1, 0, :4] = [1e-38, -3e-39, 0, 5e-40]  # float32 subnormals: below bf16's reach of exact decode
    x[2, 1, :2] = [3.3e38, -1e38]  # near float32's max: beyond 448 * 2^MAX_EXP, saturates
    x[3, 0] = np.linspace(-5, 5, 16)
    codes, exponents = fp8.quantize(x)
    assert exponents[0, 0] == 0 and not codes[0, 0].any() and exponents[0, 1] == 0  # zero rows: scale 1
    decoded = fp8.dequantize(codes, exponents, "float32")
    assert np.all(np.isfinite(decoded)) and np.all(decoded[0] == 0) and np.all(np.signbit(decoded[0, 1]))
    assert exponents[1, 0] == fp8.MIN_EXP and abs(decoded[1, 0, 0] - 1e-38) <= 2 ** -4 * 1e-38
    assert exponents[2, 1] == fp8.MAX_EXP and decoded[2, 1, 0] == np.float32(448 * 2.0 ** fp8.MAX_EXP)
    assert abs(decoded[2, 1, 1] + 1e38) <= 2 ** -4 * 1e38
    np.testing.assert_allclose(decoded[3, 0], x[3, 0], rtol=2 ** -4)
    empty_codes, empty_exponents = fp8.quantize(np.zeros((0, 3, 8), ml_dtypes.bfloat16))
    assert empty_codes.shape == (0, 3, 8) and fp8.dequantize(empty_codes, empty_exponents).shape == (0, 3, 8)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_values_are_refused_naming_where(bad):
    x = _hidden(seed=1)
    x[7, 2, 5] = bad
    with pytest.raises(CacheError, match=r"NaN/Inf \(first at token 7, layer 2, index 5\).*store them losslessly"):
        fp8.quantize(x)


def test_unknown_format_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown hidden-state format 'fp4'; use lossless or fp8_e4m3"):
        StorageConfig(hidden_format="fp4")
    result = CliRunner().invoke(cache_app, ["build", "--teacher", "unused", "--data", "unused", "--out", str(tmp_path / "c"),
                                            "--hidden-format", "fp4"])
    assert result.exit_code == 1 and "unknown hidden-state format 'fp4'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "c").exists()


def test_scale_column_problems_are_named():
    good = pa.table({"hidden_scale_exp": pa.FixedSizeListArray.from_arrays(pa.array([0, -3, 5, 119], pa.int8()), 2)})
    assert scale_problems(good, 2) == []
    out_of_range = pa.table({"hidden_scale_exp": pa.FixedSizeListArray.from_arrays(pa.array([0, -125, 5, 7], pa.int8()), 2)})
    assert scale_problems(out_of_range, 2) == ["1 fp8 scale exponents lie outside [-124, 119]"]
    assert "expected 3 int8" in scale_problems(good, 3)[0]
    assert "lacks the hidden_scale_exp column" in scale_problems(pa.table({"x": [1]}), 2)[0]


# --- a real build --------------------------------------------------------------------------------


def _config(data: str, out: Path, teacher: str, hidden_format: str, **kw) -> BuildConfig:
    # one sequence per teacher batch: bf16 outputs then do not depend on how shards are cut, so the
    # lossless and fp8 builds see identical teacher outputs
    return BuildConfig(out=str(out), corpus=CorpusConfig(data=data),
                       teacher=TeacherConfig(name_or_path=teacher, dtype="bfloat16", layers=LAYERS, top_k=8, batch_tokens=1),
                       storage=StorageConfig(shard_bytes=kw.pop("shard_bytes", 12_000), hidden_format=hidden_format), **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory, teacher_dir):
    root = tmp_path_factory.mktemp("fp8")
    teacher = teacher_dir("qwen3", torch.bfloat16)
    data = write_jsonl(root / "chat.jsonl", qa_rows(24, seed=0, prefix="f-"))
    for name in ("lossless", "fp8_e4m3"):
        build_cache(_config(data, root / name, teacher, name))
    return {"root": root, "teacher": teacher, "data": data,
            "lossless": str(root / "lossless"), "fp8": str(root / "fp8_e4m3")}


def _hidden_bytes(url: str) -> int:
    return sum(p.stat().st_size for p in Path(url).glob("shards/**/hidden.zarr/c/**/*") if p.is_file())


def test_fp8_build_reads_back_as_bfloat16_within_fp8_error_at_half_the_bytes(built):
    exact, lossy = open_cache(built["lossless"]), open_cache(built["fp8"])
    assert (exact.hidden_format, lossy.hidden_format) == ("lossless", "fp8_e4m3")
    assert lossy.manifest["hidden_format"] == "fp8_e4m3" and lossy.manifest["hidden_storage"] == "uint8"
    assert lossy.manifest["build"]["storage"]["hidden_format"] == "fp8_e4m3"
    assert lossy.hidden_dtype == "bfloat16" and len(lossy) == len(exact) == 24
    a, b = list(exact.sequences()), list(lossy.sequences())
    assert [r.id for r in a] == [r.id for r in b]
    for x, y in zip(a, b):
        assert y.hidden.dtype == ml_dtypes.bfloat16 and y.hidden.shape == x.hidden.shape
        for field in ("input_ids", "loss_mask", "topk_ids", "topk_logprobs"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
        # the reader returns exactly the quantiser's decode of the lossless values
        codes, exponents = fp8.quantize(x.hidden)
        np.testing.assert_array_equal(y.hidden.view(np.uint16), fp8.dequantize(codes, exponents).view(np.uint16))
    stacked = [np.concatenate([np.asarray(r.hidden, np.float32) for r in rs]) for rs in (a, b)]
    errors = fp8.relative_error(stacked[1], stacked[0])
    assert errors.shape == (len(LAYERS),) and np.all(errors < 0.035) and np.all(errors > 0)
    # hidden states: 1 byte per value instead of 2 (the scale exponents live in tokens.arrow)
    ratio = _hidden_bytes(built["fp8"]) / _hidden_bytes(built["lossless"])
    assert 0.49 < ratio < 0.51, ratio
    assert lossy.manifest["totals"]["bytes"] / exact.manifest["totals"]["bytes"] < 0.62
    # random access decodes the same rows as the windowed reader, and so does a read into a batch row
    np.testing.assert_array_equal(lossy["f-005"].hidden.view(np.uint16), b[5].hidden.view(np.uint16))
    shard, i = lossy.locate("f-005")
    row = lossy.padded_hidden([len(b[5])])[0]
    assert shard.read(i, out=row).hidden is row and np.array_equal(row.view(np.uint16), b[5].hidden.view(np.uint16))


def test_info_and_verify_know_the_format(built):
    info = CliRunner().invoke(cache_app, ["info", built["fp8"]])
    assert info.exit_code == 0 and "hidden       fp8_e4m3 with a power-of-two scale per token and layer" in info.output
    assert "\nhidden " not in CliRunner().invoke(cache_app, ["info", built["lossless"]]).output
    ok = CliRunner().invoke(cache_app, ["verify", built["fp8"], "--quiet"])
    assert ok.exit_code == 0 and "24 sequences verified" in ok.output, ok.output
    deep = CliRunner().invoke(cache_app, ["verify", built["fp8"], "--deep", "--device", "cpu", "--quiet"])
    assert deep.exit_code == 0 and "deep: 24 sequences re-run" in deep.output, deep.output


def test_resume_refuses_another_hidden_format_and_keeps_old_caches_lossless(built, tmp_path):
    with pytest.raises(CacheError, match=r"hidden_format differs \(cache: lossless, this build: fp8_e4m3\).*--overwrite"):
        build_cache(_config(built["data"], built["lossless"], built["teacher"], "fp8_e4m3"))
    with pytest.raises(CacheError, match=r"hidden_format differs \(cache: fp8_e4m3, this build: lossless\)"):
        build_cache(_config(built["data"], built["fp8"], built["teacher"], "lossless"))
    # a cache written before the field existed is lossless: the same lossless command resumes it
    old = tmp_path / "old"
    build_cache(_config(built["data"], old, built["teacher"], "lossless", shard_bytes=10**9))
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["hidden_format"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert open_cache(str(old)).hidden_format == "lossless"
    assert build_cache(_config(built["data"], old, built["teacher"], "lossless", shard_bytes=10**9))["complete"]
    with pytest.raises(CacheError, match="hidden_format differs"):
        build_cache(_config(built["data"], old, built["teacher"], "fp8_e4m3", shard_bytes=10**9))
    manifest["hidden_format"] = "fp4"  # written by a newer dflash
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="unknown hidden_format 'fp4' in manifest.json"):
        open_cache(str(old))


def test_verify_finds_nan_codes_in_an_fp8_shard(built, tmp_path):
    import shutil

    cache = tmp_path / "copy"
    shutil.copytree(built["fp8"], cache)
    chunk = next(p for p in sorted((cache / "shards").glob("**/hidden.zarr/c/**/*")) if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[10] = 0x7F  # e4m3fn NaN
    chunk.write_bytes(bytes(data))
    bad = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert bad.exit_code == 1
    # format 2 checks each inner chunk's crc32c as it decodes it: the damaged chunk is named before
    # its codes are (format 1 hashed the whole array, then also counted "1 NaN/Inf values")
    assert "BAD shard-r00000-000000: hidden states: a chunk's crc32c mismatch" in bad.output, bad.output


def test_deep_verify_checks_the_scales(built, tmp_path):
    """Scales off by one binade in one shard, with checksums and sizes rewritten to match: only a
    fresh teacher run can tell, and --deep names that shard's sequences."""
    import shutil

    from dflash_cache import format as fmt

    cache = tmp_path / "copy"
    shutil.copytree(built["fp8"], cache)
    record = open_cache(str(cache)).shards[2].record
    path = Path(fmt.shard_path(str(cache), record["name"], 2)) / "tokens.arrow"
    table = pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()
    column = table.column(fmt.SCALE_COLUMN).combine_chunks()
    doubled = pa.FixedSizeListArray.from_arrays(pa.array(column.values.to_numpy() + 1, pa.int8()), len(LAYERS))
    table = table.set_column(table.schema.get_field_index(fmt.SCALE_COLUMN), fmt.SCALE_COLUMN, doubled)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    record["checksums"]["tokens.arrow"], record["files"]["tokens.arrow"] = fmt.checksum(data), len(data)
    replace_shard_records(cache, {2: record})
    assert CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"]).exit_code == 0  # checksums cannot tell
    deep = CliRunner().invoke(cache_app, ["verify", str(cache), "--deep", "--device", "cpu", "--quiet"])
    named = [line for line in deep.output.splitlines() if line.startswith("MISMATCH ")]
    assert deep.exit_code == 1 and len(named) == record["sequences"] >= 1, deep.output
    assert all(f"({record['name']}): hidden states of layer" in line for line in named)


def test_training_from_an_fp8_cache(built, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(train_app, ["run", "--cache", built["fp8"], "--out", str(run), "--steps", "3",
                                            "--num-layers", "1", "--block-size", "4", "--eval-sequences", "4",
                                            "--heldout-fraction", "0.2", "--quiet"])
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses and all(np.isfinite(losses))
    assert (run / "drafter" / "model.safetensors").exists()


def test_fp8_cache_on_object_storage_reads_like_the_local_one(built, request):
    """The remote read path (whole tokens.arrow in memory, Zarr through fsspec) decodes the same."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    s3 = request.getfixturevalue("s3_server")
    url = s3.url("fp8")
    build_cache(_config(built["data"], url, built["teacher"], "fp8_e4m3"))
    remote, local = open_cache(url), open_cache(built["fp8"])
    assert remote.hidden_format == "fp8_e4m3"
    pairs = list(zip(remote.sequences(), local.sequences()))
    assert len(pairs) == 24
    for a, b in pairs:
        assert a.id == b.id and a.hidden.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a.hidden.view(np.uint16), b.hidden.view(np.uint16))
    ok = CliRunner().invoke(cache_app, ["verify", url, "--quiet"])
    assert ok.exit_code == 0, ok.output


def test_the_numpy_and_torch_decodings_give_the_same_bits():
    """info and verify decode in numpy (no torch loaded), training in torch: the same values (the NaN
    codes' payload bits may differ; a cache holds none, quantize refuses NaN)."""
    import subprocess
    import sys

    code = ("import numpy as np, sys\nfrom dflash_cache.format import fp8\n"
            "rng = np.random.default_rng(0)\ncodes = rng.integers(0, 256, (300, 4, 32), dtype=np.uint8)\n"
            "exps = rng.integers(fp8.MIN_EXP, fp8.MAX_EXP + 1, (300, 4)).astype(np.int8)\n"
            "exps[0] = fp8.MIN_EXP\nexps[1] = fp8.MAX_EXP\n"
            "a = [fp8.dequantize(codes, exps, d).astype(np.float64) for d in ('bfloat16', 'float32')]\n"
            "assert 'torch' not in sys.modules\nimport torch\n"
            "b = [fp8.dequantize(codes, exps, d).astype(np.float64) for d in ('bfloat16', 'float32')]\n"
            "print(all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True", done.stderr
