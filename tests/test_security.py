"""Doors: loopback by default, CurveZMQ keys (or an explicit --insecure) for other hosts."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import urllib.request

import pytest
import zmq

import kvshm
from kvshm.security import is_loopback, keygen, load_public_key
from servers import ServerProcess, bearer


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("keys"))
    server_pub, server_sec = keygen(os.path.join(d, "server"), "server")
    client_pub, client_sec = keygen(os.path.join(d, "client"), "client")
    allowed = os.path.join(d, "allowed")
    os.makedirs(allowed)
    shutil.copy(client_pub, allowed)
    return {"server_pub": server_pub, "server_sec": server_sec, "client_pub": client_pub,
            "client_sec": client_sec, "allowed": allowed}


def test_keygen_writes_a_private_secret(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvshm", "keygen", str(tmp_path / "k")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    secret = tmp_path / "k" / "server.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert len(load_public_key(str(tmp_path / "k" / "server.key"))) == 40


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_non_loopback_host_needs_keys_or_insecure(host):
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--host", host,
                        "--service-port", "0", "--manage-port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--host" in r.stderr and "--curve-secret-key" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_key_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "nope.key_secret"
    bad.write_text("not a certificate")
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--curve-secret-key",
                        str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--curve-secret-key" in r.stderr


def test_curve_without_allow_list_needs_an_explicit_flag(keys):
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                        "--no-manage", "--curve-secret-key", keys["server_sec"]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--curve-allow-any" in r.stderr


def test_curve_server_takes_only_clients_with_its_key(keys):
    with ServerProcess("--curve-secret-key", keys["server_sec"], "--curve-allow-any",
                       "--log-level", "WARNING") as srv:
        assert "curve public key" in srv.ready_line
        with kvshm.Client(srv.address, curve_server_key=keys["server_pub"]) as c:
            c.put("secret", b"s" * 70_000)
            assert c.get("secret") == b"s" * 70_000
        with kvshm.Client(srv.address, transport="tcp",
                          curve_server_key=load_public_key(keys["server_pub"])) as c:
            assert c.get("secret") == b"s" * 70_000
        with pytest.raises(kvshm.AuthenticationFailed, match="refused"):
            kvshm.Client(srv.address, transport="tcp", timeout=5)
        with pytest.raises(kvshm.AuthenticationFailed):
            kvshm.Client(srv.address, transport="tcp", timeout=5,
                         curve_server_key=zmq.curve_keypair()[0])
        req = urllib.request.Request(f"http://127.0.0.1:{srv.manage_port}/selftest",
                                     headers=bearer(srv.address))
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["ok"] is True
    assert srv.stderr_text.count("refused a client connection") >= 2
    assert "any client that knows this server's public key" in srv.stderr_text


def test_allowed_clients_only(keys):
    with ServerProcess("--curve-secret-key", keys["server_sec"], "--curve-allowed-clients",
                       keys["allowed"]) as srv:
        with kvshm.Client(srv.address, transport="tcp", curve_server_key=keys["server_pub"],
                          curve_keypair=keys["client_sec"]) as c:
            c.put("k", b"v")
            assert c.get("k") == b"v"
        with pytest.raises(kvshm.AuthenticationFailed, match="does not accept"):
            kvshm.Client(srv.address, transport="tcp", timeout=5,
                         curve_server_key=keys["server_pub"])   # a fresh, unlisted key
        r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "--address", srv.address,
                            "--curve-server-key", keys["server_pub"], "--curve-keypair",
                            keys["client_sec"], "stats"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["num_keys"] == 1
    assert "its key is not allowed" in srv.stderr_text
