"""Who may talk to a server: loopback by default, CurveZMQ for other hosts.

A server bound to a non-loopback address must either run with CurveZMQ
(``--curve-secret-key``: traffic encrypted, and only clients that know the server's
public key get through; with ``--curve-allowed-clients`` only listed client keys) or be
told ``--insecure`` explicitly. Keys are pyzmq's ``zmq.auth`` certificate files, made with
``kvshm keygen DIR``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Any

import zmq
import zmq.auth

__all__ = ["is_loopback", "keygen", "load_keypair", "load_public_key", "CurveServer"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def keygen(directory: str, name: str = "server", *, force: bool = False) -> tuple[str, str]:
    """Write a CurveZMQ key pair as ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret``
    (secret, mode 0600). Returns both paths.

    Raises
    ------
    FileExistsError
        A key pair of that name is there (``force`` replaces it: clients holding the old
        public key are then refused).
    OSError
        ``directory`` cannot be made or written.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    existing = [p for p in (os.path.join(directory, name + ".key"),
                            os.path.join(directory, name + ".key_secret"))
                if os.path.exists(p)]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; replacing it locks out every client "
                              "that has the old public key (use --force to do it anyway)")
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def load_keypair(path: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a ``.key_secret`` certificate file.

    Raises
    ------
    ValueError
        The file is missing, unreadable or holds no secret key.
    """
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CurveZMQ secret key from {path}: {exc}") from None
    if not secret:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


def load_public_key(key: bytes | str) -> bytes:
    """A Z85 public key given as the key itself (40 characters) or a certificate file."""
    if isinstance(key, bytes):
        key = key.decode()
    if len(key) == 40 and not os.path.exists(key):
        return key.encode()
    try:
        public, _ = zmq.auth.load_certificate(key)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key!r} is neither a 40-character Z85 key nor a readable "
                         f"certificate file: {exc}") from None
    return public


class CurveServer:
    """CurveZMQ set-up of a server's ROUTER socket, and the ZAP handler when client keys
    are restricted.

    Parameters
    ----------
    secret_key_file : str
        The server's ``.key_secret`` file.
    allowed_clients : str, optional
        Directory of client ``.key`` files; when given, other client keys are refused.
    context : zmq.Context
    """

    def __init__(self, secret_key_file: str, allowed_clients: str | None,
                 context: zmq.Context) -> None:
        self.public, self.secret = load_keypair(secret_key_file)
        self._auth: Any = None
        if allowed_clients is not None:
            if not os.path.isdir(allowed_clients):
                raise ValueError(f"{allowed_clients} is not a directory of client keys")
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(context, log=log)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=allowed_clients)

    def setup(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
