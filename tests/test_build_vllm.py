"""`dflash-cache build --engine vllm` against the transformers engine, with the real vLLM engine.

The engine tests are marked `serving` (make test-serving; needs .venv-vllm from make serving); the
pieces that need no vLLM (the wire format, the layer ids, the GPU choice) run always. One engine start per
build: the same corpus built by both engines in float32 must be the same cache (ids and masks
equal, the tapped states and fp32-head log-probs within float rounding), and a vLLM build killed
mid-way (SIGKILL through DFLASH_FAULT) must resume to exactly the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_content, cache_content, qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from dflash_cache import open_cache
from dflash_teacher.settings.vllm_args import VllmArgs
from dflash_teacher.state_receiver import StateReceiver
from dflash_teacher.vllm_engine import aux_layer_ids, worker_gpus
from dflash_teacher.vllm_extract.dflash_frames import frame_header

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--layers", "0,2", "--top-k", "6", "--shard-size", "20kB", "--quiet"]


def dtype_args(arch: str) -> list[str]:
    """float32, except the hybrid teacher: vLLM's CPU Gated DeltaNet kernel runs only in bfloat16."""
    return ["--dtype", "bfloat16" if arch == "qwen3_5" else "float32"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("vllm_build") / "chat.jsonl", qa_rows(24, seed=7, prefix="v-"))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer_dir):
    """Factory `teacher_dir(arch) -> folder`: the tiny float32 test teachers with 32-wide heads
    (vLLM's CPU attention has no kernel for conftest's 16-wide ones)."""
    from helpers import teacher_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            config = teacher_config(arch, tokenizer)
            config.head_dim = 32
            if arch == "qwen3_5":  # mrope_section sums to the rotary half-dim: 32 * 0.5 / 2 = 8
                config.rope_parameters = {**config.rope_parameters, "mrope_section": [4, 2, 2]}
                config.linear_key_head_dim = config.linear_value_head_dim = 128  # the CPU GDN kernel's only size
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"vllm_teacher_{arch}")
            AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[arch] = str(path)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def built(corpus, teacher_dir, vllm_python, tmp_path_factory):
    """Factory `built(arch, engine) -> cache folder`, each built once by the CLI."""
    done: dict[tuple[str, str], Path] = {}

    def get(arch: str, engine: str) -> Path:
        if (arch, engine) not in done:
            out = tmp_path_factory.mktemp(f"{arch}_{engine}") / "cache"
            result = CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir(arch), "--data", corpus, "--out", str(out),
                                                    "--engine", engine, "--vllm-python", vllm_python, *ARGS,
                                                    *dtype_args(arch)])
            assert result.exit_code == 0, result.output
            done[arch, engine] = out
        return done[arch, engine]

    return get


def _compare(reference: Path, other: Path) -> dict:
    a, b = open_cache(str(reference)), open_cache(str(other))
    ra, rb = {r.id: r for r in a.sequences()}, {r.id: r for r in b.sequences()}
    assert list(ra) == list(rb) and len(ra) == 24
    hidden_error = logprob_error = 0.0
    top1 = []
    for key, x in ra.items():
        y = rb[key]
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        hx, hy = np.asarray(x.hidden, np.float64), np.asarray(y.hidden, np.float64)
        hidden_error = max(hidden_error, float(np.linalg.norm(hx - hy) / np.linalg.norm(hx)))
        top1.append(x.topk_ids[:, 0] == y.topk_ids[:, 0])
        # log-probs compared by token id, so a near-tie swapped in order is not counted as an error
        for t in range(len(x.topk_ids)):
            same = np.intersect1d(x.topk_ids[t], y.topk_ids[t])
            ex = dict(zip(x.topk_ids[t].tolist(), x.topk_logprobs[t].tolist()))
            ey = dict(zip(y.topk_ids[t].tolist(), y.topk_logprobs[t].tolist()))
            logprob_error = max([logprob_error] + [abs(ex[i] - ey[i]) for i in same.tolist()])
            assert len(same) >= len(x.topk_ids[t]) - 1  # at most the k-th place differs (a near-tie)
    return {"hidden": hidden_error, "logprob": logprob_error, "top1": float(np.concatenate(top1).mean())}


@pytest.mark.serving
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_both_engines_build_the_same_cache(arch, built):
    """qwen3_5: the hybrid production architecture; taps 0 and 2 are Gated DeltaNet layers."""
    reference, other = built(arch, "transformers"), built(arch, "vllm")
    found = _compare(reference, other)
    if arch == "qwen3_5":  # bfloat16 (vLLM's CPU Gated DeltaNet): two engines' bf16 kernels; measured
        # 2.9e-3, 3.9e-3 and 99.4%. All-zero or missing linear-attention states would be ~1.0 apart.
        assert found["top1"] >= 0.98 and found["hidden"] < 1e-2 and found["logprob"] < 2e-2, found
    else:
        assert found["top1"] == 1.0 and found["hidden"] < 1e-5 and found["logprob"] < 1e-4, found
    a, b = (json.loads((path / "manifest.json").read_text()) for path in (reference, other))
    assert a["build"]["engine"] == "transformers" and b["build"]["engine"] == "vllm"
    assert "vllm_python" not in b["build"]
    # the same shards, sequences and sizes: the cut depends on tokens only, never on the engine
    records = [[(s.record["name"], list(s.record["rows"]), s.record["sequences"], s.record["tokens"])
                for s in open_cache(str(path)).shards] for path in (reference, other)]
    assert records[0] == records[1] and records[0]
    assert b["last_run"]["padding_fraction"] == 0.0  # vLLM packs sequences


@pytest.mark.serving
def test_a_killed_vllm_build_resumes_to_the_uninterrupted_cache(built, corpus, teacher_dir, vllm_python, tmp_path):
    clean = built("qwen3", "vllm")
    assert len(open_cache(str(clean)).shards) >= 4
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "cli.cache", "build", "--teacher", teacher_dir("qwen3"), "--data", corpus,
               "--out", str(out), "--engine", "vllm", "--vllm-python", vllm_python, *ARGS, *dtype_args("qwen3")]
    proc = subprocess.run(command, cwd=ROOT, env={**os.environ, "DFLASH_FAULT": "after_commit_record:2"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr  # SIGKILL at the second commit: no cleanup ran
    assert len(list((out / "shards").rglob("shard-*.json"))) == 2
    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming: 2 committed shard(s) kept" in rerun.stderr
    assert open_cache(str(out)).complete
    assert_same_content(cache_content(clean), cache_content(out))


@pytest.mark.serving
def test_the_engine_gets_the_next_shard_first_and_the_cache_is_unchanged(corpus, teacher_dir, vllm_python, tmp_path,
                                                                         monkeypatch):
    """The build sends shard k + 1 to the engine before it takes shard k's states (the engine runs
    it while the build receives, checks and writes shard k); with one shard per generate
    (generate_tokens 1) the cache is byte for byte the one built a shard at a time."""
    from dflash_teacher.vllm_engine import VllmTeacher
    from dflash_teacher.vllm_process import VllmWorker

    receive = VllmWorker.receive
    seen = []  # (batch received, batches sent by then)

    def spied(worker):
        seen.append((worker.in_flight[0][0], worker.sent))
        return receive(worker)

    def build(out: Path) -> Path:
        result = CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir("qwen3"), "--data", corpus, "--out",
                                                str(out), "--engine", "vllm", "--vllm-python", vllm_python, *ARGS,
                                                *dtype_args("qwen3"), "--vllm-args", '{"generate_tokens": 1}'])
        assert result.exit_code == 0, result.output
        return out

    monkeypatch.setattr(VllmWorker, "receive", spied)
    pipelined = build(tmp_path / "pipelined")
    shards = len(open_cache(str(pipelined)).shards)
    assert shards >= 4 and [b for b, _ in seen] == list(range(shards))
    assert all(sent == batch + 2 for batch, sent in seen[:-1]) and seen[-1][1] == shards, seen
    monkeypatch.setattr(VllmTeacher, "shards_in_flight", 1)
    seen.clear()
    one_at_a_time = build(tmp_path / "one")
    assert all(sent == batch + 1 for batch, sent in seen), seen
    assert_same_content(cache_content(one_at_a_time), cache_content(pipelined))


def test_data_parallel_is_refused_in_one_line_naming_torchrun(corpus, teacher_dir):
    from dflash_common.errors import ConfigError
    from dflash_teacher.settings.vllm_args import parse_vllm_args

    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 4"):
        parse_vllm_args('{"data_parallel_size": 4}')
    assert "data_parallel_size" not in VllmArgs().engine_args(100)
    result = CliRunner().invoke(cache_app, ["build", "--teacher", "unused", "--data", corpus, "--out", "/tmp/unused-dp",
                                            "--engine", "vllm", "--vllm-args", '{"data_parallel_size": 2}'])
    assert result.exit_code != 0 and "one build process per GPU" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_no_torchrun_variable_reaches_the_vllm_process(monkeypatch):
    from dflash_teacher.vllm_engine import TORCHRUN_VARIABLES, worker_environment

    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    for key, value in torchrun.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = worker_environment(VllmArgs())
    seen = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"], env=env,
                          capture_output=True, text=True, check=True)
    child = json.loads(seen.stdout)
    assert not set(TORCHRUN_VARIABLES) & child.keys() and not set(torchrun) & child.keys()
    assert child["CUDA_VISIBLE_DEVICES"] == "1"  # the rank's own GPU, chosen before the scrub


def test_no_vllm_port_or_group_variable_reaches_a_vllm_process(monkeypatch):
    """Eight engines of a node handed one VLLM_PORT bind the same ports; each engine started here
    is a world of one that chooses its own. The eval's and the server's vLLM get the same scrub."""
    from dflash_common.vllm_env import vllm_environment
    from dflash_teacher.vllm_engine import worker_environment

    placement = {"VLLM_PORT": "29600", "VLLM_DP_MASTER_PORT": "29700", "VLLM_DP_MASTER_IP": "10.0.0.1",
                 "VLLM_DP_RANK": "3", "VLLM_DP_SIZE": "8", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}
    kept = {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_LOGGING_LEVEL": "DEBUG", "MY_PORT": "8080"}
    for key, value in {**placement, **kept}.items():
        monkeypatch.setenv(key, value)
    for env in (worker_environment(VllmArgs()), vllm_environment(1)):
        seen = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"], env=env,
                              capture_output=True, text=True, check=True)
        child = json.loads(seen.stdout)
        assert not set(placement) & child.keys(), set(placement) & child.keys()
        assert {k: child.get(k) for k in kept} == kept


def test_a_vllm_outside_the_connectors_range_is_named_in_one_line():
    from dflash_teacher.vllm_engine import version_note

    assert version_note("0.32.0") is None and version_note("0.32.1+cpu") is None
    for other in ("0.31.2", "0.33.0", None):
        note = version_note(other)
        assert note and "vllm==0.32.0" in note and "\n" not in note


def test_taps_become_vllm_aux_ids_and_the_last_layer_is_added():
    # vLLM's aux id L is the input of layer L: our tap L (its output) is L + 1; the final norm's
    # input, the last layer's output, is num_layers
    assert aux_layer_ids([1, 16, 31, 46, 61], 64) == [2, 17, 32, 47, 62, 64]
    assert aux_layer_ids([0, 2], 4) == [1, 3, 4]


@pytest.mark.parametrize("env, tp, count, expected", [
    ({"LOCAL_RANK": "3"}, 1, None, "3"),
    ({}, 1, 8, None),  # not under torchrun: the engine sees what the build sees
    ({"LOCAL_RANK": "0"}, 8, None, "0,1,2,3,4,5,6,7"),  # one rank per node
    ({"LOCAL_RANK": "3"}, 2, 8, "6,7"),  # 4 ranks of 2 GPUs
    # the launcher set CUDA_VISIBLE_DEVICES node-wide (SLURM gres): the rank's slice of its list
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, 1, None, "1"),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, 4, "6,7"),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "GPU-5e1a,GPU-77b0"}, 1, 2, "GPU-77b0"),
    # the launcher gave each rank only its own GPUs
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "5"}, 1, 1, "5"),
    ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "6,7"}, 2, None, "6,7"),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": ""}, 1, None, ""),  # every GPU hidden: vLLM's CPU build
])
def test_a_torchrun_rank_gives_its_engine_its_own_gpus(env, tp, count, expected):
    assert worker_gpus(env, VllmArgs(tensor_parallel_size=tp), count) == expected


@pytest.mark.parametrize("env, tp, named", [
    ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, 1, "LOCAL_RANK 2 needs GPU 2 but CUDA_VISIBLE_DEVICES=0,1 has 2 GPU(s)"),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1,2"}, 2, "LOCAL_RANK 1 needs GPUs 2..3 (2 a rank) but CUDA_VISIBLE_DEVICES=0,1,2"),
])
def test_too_few_gpus_for_a_ranks_engine_is_one_line(env, tp, named):
    from dflash_common.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        worker_gpus(env, VllmArgs(tensor_parallel_size=tp))
    assert named in str(caught.value) and "\n" not in str(caught.value)


RANK_ENGINE = """
import json, os, sys
from dflash_teacher.settings.vllm_args import VllmArgs
from dflash_teacher.vllm_engine import worker_environment
env = worker_environment(VllmArgs())
with open(os.path.join(sys.argv[1], "rank-" + os.environ["LOCAL_RANK"] + ".json"), "w") as f:
    json.dump({"CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES")}, f)
"""


@pytest.mark.slow
def test_two_torchrun_ranks_under_a_node_wide_gpu_list_start_engines_on_different_gpus(tmp_path):
    """Issue 42's reproduction: torchrun --nproc-per-node 2 under CUDA_VISIBLE_DEVICES=0,1 (what
    SLURM's gres sets for the whole node) handed both ranks' engines 0,1, so both ran on GPU 0."""
    script = tmp_path / "rank_engine.py"
    script.write_text(RANK_ENGINE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "CUDA_VISIBLE_DEVICES": "0,1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text())["CUDA_VISIBLE_DEVICES"] for r in (0, 1)]
    assert seen == ["0", "1"]


def test_states_sent_as_frames_are_taken_by_request_in_any_order():
    import socket

    receiver = StateReceiver(layers=2, hidden=3)
    receiver.engine_pid = os.getpid()  # this process plays the engine
    try:
        states = {"a": np.arange(24, dtype=np.float32).reshape(4, 2, 3), "b": np.full((2, 2, 3), 7, np.float32)}
        bf16_bits = np.array([[[0x3F80, 0xC000, 0x0000], [0, 0, 0]]], dtype=np.uint16).view(np.int16)  # 1.0, -2.0, 0.0 in bfloat16
        receiver.expect([4, 2, 1])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect("\0" + receiver.name)
            conn.sendall(frame_header({"secret": receiver.secret}))
            for key in ("b", "a"):
                conn.sendall(frame_header({"id": key, "shape": list(states[key].shape), "dtype": "float32"},
                                          states[key].nbytes) + states[key].tobytes())
            conn.sendall(frame_header({"id": "c", "shape": [1, 2, 3], "dtype": "bfloat16"}, 12) + bf16_bits.tobytes())
        got = receiver.take(["a", "b", "c"], alive=lambda: True, timeout_s=30)
        np.testing.assert_array_equal(got[0], states["a"])
        np.testing.assert_array_equal(got[1], states["b"])
        np.testing.assert_array_equal(got[2], bf16_bits)  # kept as bits: the teacher views them as bfloat16
        assert receiver.states == {} and receiver.refusals == 0  # taken states are not kept
        # an engine that died before sending is noticed instead of waited for
        assert receiver.take(["never"], alive=lambda: False, timeout_s=30) == []
    finally:
        receiver.close()


def _session(sid: int) -> dict[int, str]:
    """pid -> command line of every process in session `sid` (the worker's: it leads its own)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            if int(stat[stat.rindex(b")") + 2:].split()[3]) == sid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


def _worker_of(build_pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"extract_worker.py" in (entry / "cmdline").read_bytes():
                stat = (entry / "stat").read_bytes()
                if int(stat[stat.rindex(b")") + 2:].split()[1]) == build_pid:
                    return int(entry.name)
        except (OSError, ValueError):
            continue
    return None


@pytest.mark.serving
@pytest.mark.parametrize("victim", ["worker", "build"])
def test_a_worker_or_build_killed_mid_build_takes_its_engine_with_it(teacher_dir, vllm_python, tmp_path, victim):
    """SIGKILL of extract_worker.py mid-build left VLLM::EngineCore, VLLM::Worker and the resource tracker
    running (re-parented to PID 1), and the error blamed a start-up warning. The same must hold
    when the build itself is killed (nothing of it runs to clean up)."""
    import signal
    import time

    corpus = write_jsonl(tmp_path / "long.jsonl", qa_rows(240, seed=3, prefix="k-"))
    out = tmp_path / "cache"
    build = subprocess.Popen([sys.executable, "-m", "cli.cache", "build", "--teacher", teacher_dir("qwen3"), "--data", corpus,
                              "--out", str(out), "--engine", "vllm", "--vllm-python", vllm_python, *ARGS,
                              *dtype_args("qwen3"), "--vllm-args", '{"generate_tokens": 1}'],  # commits from the first generate on
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 540
        while not list((out / "shards").rglob("shard-*.json")) and build.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert build.poll() is None, build.communicate()
        worker = _worker_of(build.pid)
        engine = _session(worker)
        assert any("VLLM::" in cmd for cmd in engine.values()) and len(engine) >= 2, engine  # the engine runs
        os.kill(worker if victim == "worker" else build.pid, signal.SIGKILL)
        _, err = build.communicate(timeout=120)
    finally:
        if build.poll() is None:
            build.kill()
    if victim == "worker":
        assert build.returncode == 1, err
        assert err.strip().splitlines()[-1].startswith("error: vLLM's engine stopped (killed by SIGKILL); its log is "), err
    else:
        assert build.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while (left := _session(worker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == {}, left


ATTACKER = r"""
import json, socket, struct, sys, time
build, name = sys.argv[1], None
def frame(header):
    text = json.dumps(header).encode()
    return struct.pack("<I", len(text)) + text
attacks = [b"\x05\x00\x00\x00hello", b"\xff\xff\xff\xff",
           frame({"id": "1-0a1b2c3d", "shape": [-1], "dtype": "float32", "nbytes": 0}),
           frame({"id": "1-0a1b2c3d", "shape": [5, 3, 64], "dtype": "float32", "nbytes": 3840}) + bytes(3840),
           frame({"secret": "guess"}) + frame({"id": "2-0", "shape": [2**20, 3, 64], "dtype": "float32", "nbytes": 2**32})]
tries = 0
deadline = time.time() + 900
while time.time() < deadline:
    found = [line.split()[-1][1:] for line in open("/proc/net/unix") if "@dflash-hs-%s-" % build in line]
    if not found:
        if tries:
            break  # the build closed its socket
        time.sleep(0.02)
        continue
    held = []
    for payload in attacks * 10:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect("\0" + found[0])
            tries += 1
            conn.sendall(payload)
            held.append(conn)
        except OSError:
            pass
    time.sleep(0.1)
    for conn in held:
        conn.close()
print(tries)
"""


@pytest.mark.serving
def test_a_foreign_process_can_neither_stop_nor_feed_a_build(built, corpus, teacher_dir, vllm_python, tmp_path):
    """Any local user could end a build (9 bytes of non-JSON), make it allocate 4 GiB per
    connection, or park frames in it: the socket's name is in /proc/net/unix."""
    import shutil

    clean = built("qwen3", "vllm")
    out = tmp_path / "attacked"
    build = subprocess.Popen([sys.executable, "-m", "cli.cache", "build", "--teacher", teacher_dir("qwen3"), "--data", corpus,
                              "--out", str(out), "--engine", "vllm", "--vllm-python", vllm_python, *ARGS,
                              *dtype_args("qwen3")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attacker = subprocess.Popen([shutil.which("python3", path="/usr/bin:/bin") or "python3", "-c", ATTACKER, str(build.pid)],
                                user="nobody", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        _, err = build.communicate(timeout=900)
        tries, attack_err = attacker.communicate(timeout=60)
    finally:
        for proc in (build, attacker):
            if proc.poll() is None:
                proc.kill()
    assert build.returncode == 0, err
    assert int(tries) >= 50, (tries, attack_err)  # the attacks reached the socket
    assert "refused a connection to the build's state socket: process" in err and "uid 65534" in err, err
    assert_same_content(cache_content(clean), cache_content(out))


@pytest.mark.serving
def test_cross_check_of_a_vllm_build_of_the_hybrid_teacher(corpus, teacher_dir, vllm_python, tmp_path):
    """--cross-check with --engine vllm loads the transformers teacher beside the engine and records
    how far vLLM's captures (Gated DeltaNet taps 0 and 2 included) are from it; all-zero captures
    would be 1.0 apart and stop the build."""
    out = tmp_path / "cache"
    result = CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir("qwen3_5"), "--data", corpus, "--out", str(out),
                                            "--engine", "vllm", "--vllm-python", vllm_python, *ARGS, *dtype_args("qwen3_5"),
                                            "--cross-check", "3"])
    assert result.exit_code == 0, result.output
    check = json.loads((out / "manifest.json").read_text())["last_run"]["cross_check"]
    assert check["sequences"] == 3 and set(check["hidden_relative"]) == {"0", "2"}, check
    assert 0 < max(check["hidden_relative"].values()) < 0.05 and check["logprobs_relative"] < 0.05, check
    assert check["top1_agreement"] >= 0.95, check
