"""The perf/ scripts of issues 13 and 16 still run: each in its --quick smoke mode exits 0,
prints its baseline rows beside kvshm's, writes its --json, and leaves no segment behind.

No figure is checked (quick runs are too small to mean anything, and this machine is
shared): only that every section ran, every byte check passed (a failed check exits
non-zero) and the output names what it compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from servers import shm_segments

PERF = os.path.join(os.path.dirname(__file__), "..", "perf")
TIMEOUT = 240


def run_script(name: str, *args: str) -> str:
    proc = subprocess.Popen([sys.executable, os.path.join(PERF, name), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{name} did not finish within {TIMEOUT} s\n{out}\n{err}")
    left = shm_segments(f"kvshm-test-{proc.pid}-")       # its servers' segments
    assert not left, f"{name} left {left}"
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{out}\n{err}"
    return out


def test_bench_small_quick(tmp_path):
    js = tmp_path / "small.json"
    out = run_script("bench_small.py", "--quick", "--json", str(js))
    for row in ("baseline zmq DEALER/ROUTER echo, ipc", "baseline numpy copyto 4 KiB + 1 call",
                "baseline tobytes 4 KiB + 1 call", "kvshm get_into 4 KiB",
                "get_into p50 / echo p50", "numpy copy", "kvshm exists, 1 key",
                "kvshm match_prefix, 64 keys", "dict membership",
                "baseline zmq DEALER/ROUTER echo, tcp", "BATCH (TCP", "BYSTANDER", "idle"):
        assert row in out, f"no {row!r} in\n{out}"
    res = json.loads(js.read_text())
    assert {"local", "remote", "batch", "bystander"} <= set(res)
    assert [r["clients"] for r in res["remote"]["rows"]] == [1, 2]
    # the server's CPU split: its libzmq I/O thread's part is a part of the whole (none
    # under the native listener, the default: the loop thread reads and writes itself)
    assert "libzmq's I/O thread" in out
    kind = res["remote"]["listener"]
    assert kind == (os.environ.get("KVSHM_LISTENER") or "native")
    for r in res["remote"]["rows"]:
        for op in ("put", "get"):
            io = r[f"kvshm_{op}_io_us"]
            assert (0 < io if kind == "libzmq" else 0 <= io) and io <= r[f"kvshm_{op}_cpu_us"], r
    assert {s["bytes"] for s in res["local"]["single"]} == {64 << 10, 1 << 20}
    # put_batch one PUT and pipelined, in turns
    assert "put_batch as one PUT" in out
    assert res["batch"]["put_pipe"] > 0 and res["batch"]["put_cpu_pipe"] >= 0
    if "redis" not in " ".join(res["unavailable"]):
        assert "redis set" in out and "redis pipelined SET" in out
        assert all("redis_get_rps" in r for r in res["remote"]["rows"])


def test_bench_srvio_quick(tmp_path):
    js = tmp_path / "srvio.json"
    out = run_script("bench_srvio.py", "--quick", "--json", str(js))
    assert "SERVER TRANSPORT ALONE" in out and "zmtp/zmq" in out, out
    res = json.loads(js.read_text())
    assert [r["clients"] for r in res["rows"]] == [1, 2]
    assert "WITH THE STORE" in out, out
    for r in res["rows"]:
        # every phase served requests (a client raises on a wrong reply, the prototype
        # on a request its fast path declined); only the libzmq servers have an I/O thread
        for a, b in (("zmq", "zmtp"), ("zmq+store", "zmtp+store")):
            assert r[f"{a}_rps"] > 0 and r[f"{b}_rps"] > 0, r
            assert 0 < r[f"{a}_io_us"] <= r[f"{a}_srv_us"] and r[f"{b}_io_us"] == 0, r


def test_bench_index_quick(tmp_path):
    js = tmp_path / "index.json"
    out = run_script("bench_index.py", "--quick", "--json", str(js))
    assert "server RssAnon" in out and "baseline Python dict" in out, out
    res = json.loads(js.read_text())
    assert res["keys"] == 20_000 and res["dict_bytes_per_key"] > 0


def test_batch_lookup_driver_quick():
    out = run_script("batch_lookup_driver.py", "--quick")
    for label in ("18-byte keys", "40-byte keys"):
        line = next(x for x in out.splitlines() if label in x)
        assert "dict" in line and "exists" in line and "match" in line, out
    out = run_script("batch_lookup_driver.py", "--quick", "--only", "match")
    assert "exists" not in out.split("\n", 1)[1] and "match" in out, out


def test_batch_lookup_driver_breakdown_quick():
    # where 40-byte keys lose to 18-byte ones: key length, table size, or the slots a key
    # lies past its home (each table's keys' share by displacement, from its segment)
    out = run_script("batch_lookup_driver.py", "--quick", "--breakdown")
    for label in ("18 alone", "40 alone", "18 in 18+40", "40 in 18+40"):
        line = next(x for x in out.splitlines() if x.strip().startswith(label))
        assert "displacement mean" in line and "at home" in line and "exists" in line, out
    for cohort in ("displaced 0", "displaced 1", "displaced 2+"):
        line = next(x for x in out.splitlines() if cohort in x)
        assert "exists" in line and "keys" in line, out


def test_bench_index_refuses_what_does_not_fit():
    proc = subprocess.run([sys.executable, os.path.join(PERF, "bench_index.py"),
                           "--keys", str(1 << 40)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Rerun with --keys" in proc.stdout


def test_bench_peers_quick_without_peers(tmp_path):
    """With no peer venvs, the peers' rows say why they are unavailable; the references
    and kvshm's rows still run."""
    js = tmp_path / "peers.json"
    out = run_script("bench_peers.py", "--quick", "--peers-cache", str(tmp_path / "none"),
                     "--json", str(js))
    header = next(line for line in out.splitlines() if "memcpy" in line and "kvshm shm" in line)
    for col in ("memcpy", "raw socket", "kvshm shm", "kvshm tcp"):
        assert col in header, out
    assert "single put 64K MB/s" in out and "4 KiB get into p50 us" in out, out
    assert "ratios: kvshm shm vs each row" in out
    for peer in ("redis", "lm-server", "mooncake", "infinistore"):
        assert f"unavailable: {peer}: no venv at" in out, out
    res = json.loads(js.read_text())
    assert "put1_1M" in res["rows"]["kvshm-tcp"] and "lat4k_into_p50" in res["rows"]["raw-socket"]


def test_peers_env_rejects_unknown_peer(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "peers-env.sh")
    proc = subprocess.run(["bash", script, "no-such-peer"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "KVSHM_PEERS_CACHE": str(tmp_path)})
    assert proc.returncode == 2
    assert "unknown peer 'no-such-peer'" in proc.stderr


def test_bench_shmput_quick(tmp_path):
    js = tmp_path / "shmput.json"
    out = run_script("bench_shmput.py", "--quick", "--json", str(js))
    for row in ("shm-base", "shm-packed", "shm-inline", "tcp", "vs tcp", "load at end"):
        assert row in out, f"no {row!r} in\n{out}"
    res = json.loads(js.read_text())
    assert set(res["rows"]) == {"shm-base", "shm-packed", "shm-inline", "tcp"}
