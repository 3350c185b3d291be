"""Who may talk to a server: a door token on the host, CurveZMQ for other hosts.

Door token. Every server makes a random secret at start-up and writes it, mode 0600, to
its token file: by default ``/dev/shm/kvshm-run-<uid>/<port>.token`` (a 0700 directory of
the server's user, in the same scope as the pool, so a container sharing /dev/shm finds
it), and ``token`` in the server's private ipc directory. A HELLO must carry it (or come
over a CURVE-authenticated connection); a client of the same user finds it by itself
(:func:`find_token`), another user is given access with ``--token-file PATH`` (the
server also writes the token there, mode 0640: give that file to the user's group) and
the client's ``token_file=`` or ``$KVSHM_TOKEN_FILE``. The management port asks for the
same token (``Authorization: Bearer <hex>``) on every endpoint that changes or reveals
data.

Operator token. Beside its door token every server writes a second secret, the operator
token, mode 0600, to ``/dev/shm/kvshm-run-<uid>/<port>.operator`` (and ``operator`` in
its ipc directory); it is never written to ``--token-file``. A HELLO carrying it opens an
operator session (:attr:`kvshm.store.Session.operator`), as does a proof-holding local
client of the server's own uid or root: only those may DRAIN, PURGE and EVICT over the
wire, and ``POST /purge`` on the management port asks for it as its bearer token. A
client of the server's user finds it by itself (:func:`find_operator_token`), so
``kvshm ctl purge`` / ``drain`` need no flag; a door-token holder of another user reads
and writes but gets UNAUTHORIZED for those ops.

Dead servers' files. A server holds an flock on each token file it wrote for as long as
it runs; :func:`cleanup_tokens` (server start-up, ``kvshm ctl cleanup``) removes the
unlocked ones (left by a server killed with SIGKILL), never a live server's.

A server bound to a non-loopback address must either run with CurveZMQ
(``--curve-secret-key``: traffic encrypted, and only clients that know the server's
public key get through; with ``--curve-allowed-clients`` only listed client keys) or be
told ``--insecure`` explicitly. Keys are pyzmq's ``zmq.auth`` certificate files, made with
``kvshm keygen DIR``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import stat
import time
from typing import Any

import zmq
import zmq.auth

__all__ = ["is_loopback", "keygen", "load_keypair", "load_public_key", "CurveServer",
           "DoorToken", "find_token", "find_operator_token", "token_path",
           "operator_token_path", "cleanup_tokens", "read_token_file", "TOKEN_ENV"]

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


#: Environment variable naming a token file for clients (another user's server).
TOKEN_ENV = "KVSHM_TOKEN_FILE"
_RUN_DIR = "/dev/shm"


#: How many names a user's run directory may take: ``kvshm-run-<uid>``, then
#: ``kvshm-run-<uid>.1`` ... ``.7`` when another user made the earlier ones first.
_RUN_DIR_NAMES = 8


def _run_dir_names(uid: int) -> list[str]:
    base = os.path.join(_RUN_DIR, f"kvshm-run-{uid}")
    return [base] + [f"{base}.{i}" for i in range(1, _RUN_DIR_NAMES)]


def _is_private_dir(path: str, uid: int) -> bool | None:
    """True: a 0700 directory of ``uid``; None: nothing there; False: anything else
    (another user's, a file, a symlink: not to be used)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077


def run_dirs(uid: int | None = None) -> list[str]:
    """The run directories of ``uid`` (default this user) that exist and are its own."""
    u = os.getuid() if uid is None else uid
    return [d for d in _run_dir_names(u) if _is_private_dir(d, u)]


def run_dir(uid: int | None = None) -> str:
    """The per-user directory of token files: ``/dev/shm/kvshm-run-<uid>``, or, when
    another user made that name first (/dev/shm is world-writable: anyone may), the
    first of ``kvshm-run-<uid>.1`` ... ``.7`` that is ``uid``'s own or free. Clients
    look in every one that is ``uid``'s own (:func:`token_path`)."""
    u = os.getuid() if uid is None else uid
    names = _run_dir_names(u)
    for d in names:
        if _is_private_dir(d, u) is not False:
            return d
    return names[0]


def token_path(endpoint: str, uid: int | None = None) -> str | None:
    """Default token file of the server at ``endpoint`` (``tcp://h:port`` or
    ``ipc:///dir/service.sock``); None for inproc."""
    if endpoint.startswith("ipc://"):
        return os.path.join(os.path.dirname(endpoint[len("ipc://"):]), "token")
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[-1]
        if port.isdigit():
            name = f"{port}.token"
            for d in run_dirs(uid):       # the server's one (a squatted name skipped)
                if os.path.lexists(os.path.join(d, name)):
                    return os.path.join(d, name)
            return os.path.join(run_dir(uid), name)
    return None


def operator_token_path(endpoint: str, uid: int | None = None) -> str | None:
    """Default operator token file of the server at ``endpoint`` (beside its door token
    file: ``<port>.operator``, or ``operator`` in its ipc directory); None for inproc."""
    path = token_path(endpoint, uid)
    if path is None:
        return None
    if path.endswith(".token"):
        return path[:-len(".token")] + ".operator"
    return os.path.join(os.path.dirname(path), "operator")


def _read_private(path: str, live: bool = False) -> bytes:
    """The secret in token file ``path``; with ``live``, only while a server holds its
    lock (a live server flocks each token file it wrote: a dead one's file, left until
    cleanup, must not be sent to whoever took its port since)."""
    # O_NONBLOCK: opening a FIFO put in its place must not wait for a writer (forever)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 256:
            raise ValueError(f"{path} is not a kvshm token file")
        if live:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass                    # held: its server runs
            else:
                raise ValueError(f"{path} was left by a server that is gone")
        data = os.read(fd, 256).strip()
    finally:
        os.close(fd)
    try:
        return bytes.fromhex(data.decode())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{path} is not a kvshm token file") from None


def find_token(endpoint: str, token_file: str | None = None) -> bytes | None:
    """The door token for ``endpoint``: from ``token_file``, ``$KVSHM_TOKEN_FILE``, or
    the default place of a server of this user. None when none is readable (the server
    then refuses the HELLO, saying so).

    Raises
    ------
    ValueError
        ``token_file`` (given explicitly) cannot be read.
    """
    explicit = token_file or os.environ.get(TOKEN_ENV)
    if explicit:
        try:
            return _read_private(explicit)
        except OSError as exc:
            raise ValueError(f"cannot read the kvshm token file {explicit}: {exc}") from None
    path = token_path(endpoint)
    if path is None or not _on_this_host(endpoint):
        return None     # never hand a local server's token to another host
    try:
        return _read_private(path, live=True)
    except (OSError, ValueError):
        return None


def read_token_file(path: str) -> bytes:
    """The secret in a kvshm token file (hex, as servers write them).

    Raises
    ------
    ValueError
        The file cannot be read or is not a token file.
    """
    try:
        return _read_private(path)
    except OSError as exc:
        raise ValueError(f"cannot read the kvshm token file {path}: {exc}") from None


def find_operator_token(endpoint: str) -> bytes | None:
    """The operator token of the server at ``endpoint`` when this user can read it (a
    server of this user on this host); None otherwise (never raises)."""
    path = operator_token_path(endpoint)
    if path is None or not _on_this_host(endpoint):
        return None
    try:
        return _read_private(path, live=True)
    except (OSError, ValueError):
        return None


def _on_this_host(endpoint: str) -> bool:
    """True for ipc endpoints and tcp endpoints whose address is one of this host's."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_UDP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            if ipaddress.ip_address(addr[0]).is_loopback:
                continue
        except ValueError:
            return False
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.bind((addr[0], 0))       # only an address of this host binds
        except OSError:
            return False
        finally:
            probe.close()
    return bool(infos)


class DoorToken:
    """The server's door token and the files it is written to (removed at :meth:`close`).

    Parameters
    ----------
    endpoints : list of str
        The bound service endpoints (a token file for each tcp port / ipc directory).
    extra_file : str, optional
        ``--token-file``: also write it there (mode 0640), for another user or group.
    shared_file : str, optional
        ``--door-token-file``: take the token from this existing token file instead of
        drawing one (the servers of a cluster without CURVE share one door token, so
        that a client holding that file gets into every member).
    """

    def __init__(self, endpoints: list[str], extra_file: str | None = None,
                 shared_file: str | None = None) -> None:
        if shared_file:
            try:
                self.token = _read_private(shared_file)
            except OSError as exc:
                raise ValueError(f"cannot read the door token file {shared_file}: "
                                 f"{exc}") from None
            if len(self.token) < 16:
                raise ValueError(f"{shared_file}: a door token has at least 16 bytes")
        else:
            self.token = os.urandom(32)
        self.hex = self.token.hex()
        self.operator = os.urandom(32)
        self.files: list[str] = []
        self._written: dict[str, bytes] = {}    # path -> the secret written there
        self._fds: list[int] = []               # flocked while this server runs
        try:
            for ep in endpoints:
                path = token_path(ep)
                if path is None:
                    continue
                for attempt in range(3):
                    try:
                        if os.path.dirname(path) in _run_dir_names(os.getuid()):
                            _private_dir(os.path.dirname(path))
                        self._write(path, 0o600, self.token)
                        self._write(operator_token_path(ep) or "", 0o600, self.operator)
                        break
                    except FileNotFoundError:   # the last server of this user just
                        if attempt == 2:         # removed the empty directory: again
                            raise
            if extra_file and extra_file != shared_file:
                self._write(extra_file, 0o640, self.token)
        except BaseException:
            self.close()
            raise

    def _write(self, path: str, mode: int, secret: bytes) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, mode)
        try:
            # locked before it has its name: cleanup_tokens never sees it unlocked
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, mode)
            os.write(fd, secret.hex().encode() + b"\n")
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._fds.append(fd)
        self.files.append(path)
        self._written[path] = secret

    def check(self, presented: Any) -> bool:
        import hmac

        if isinstance(presented, str):
            try:
                presented = bytes.fromhex(presented.strip())
            except ValueError:
                return False
        return type(presented) is bytes and hmac.compare_digest(presented, self.token)

    def check_operator(self, presented: Any) -> bool:
        """Whether ``presented`` (bytes or hex) is this server's operator token."""
        import hmac

        if isinstance(presented, str):
            try:
                presented = bytes.fromhex(presented.strip())
            except ValueError:
                return False
        return type(presented) is bytes and hmac.compare_digest(presented, self.operator)

    def close(self) -> None:
        for path in self.files:
            try:
                if _read_private(path) == self._written.get(path):  # not a newer server's
                    os.unlink(path)
            except (OSError, ValueError):
                pass
            if os.path.dirname(path) in _run_dir_names(os.getuid()):
                try:
                    os.rmdir(os.path.dirname(path))  # the last server of this user
                except OSError:             # leaves nothing; others' tokens are still there
                    pass
        self.files.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def cleanup_tokens(directory: str | None = None, dry_run: bool = False,
                   grace: float = 60.0) -> list[str]:
    """Remove the token files of dead servers from ``directory`` (default this user's
    :func:`run_dir`): a live server holds an flock on each of its files, so a file that
    can be locked was left by a server that is gone (SIGKILL). Half-written ``.tmp``
    files are removed once unlocked and older than ``grace`` seconds. Returns the paths
    removed (or that would be, with ``dry_run``); the directory too when it is left
    empty. Never raises for a file that vanishes meanwhile. Without ``directory``, every
    run directory of this user (:func:`run_dirs`: a squatted name moves it) is cleaned.
    """
    if directory is None:
        return [p for d in run_dirs() for p in _cleanup_tokens(d, dry_run, grace, True)]
    return _cleanup_tokens(directory, dry_run, grace, False)


def _cleanup_tokens(d: str, dry_run: bool, grace: float, rmdir: bool) -> list[str]:
    try:
        names = os.listdir(d)
    except OSError:
        return []
    removed: list[str] = []
    now = time.time()
    for name in names:
        if not name.endswith((".token", ".operator", ".tmp")):
            continue
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            if name.endswith(".tmp") and now - st.st_mtime < grace:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue            # a live server holds it
            try:
                cur = os.lstat(path)
            except OSError:
                continue
            if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                continue            # replaced by a new server meanwhile
            if not dry_run:
                try:
                    os.unlink(path)
                except OSError:
                    continue
            removed.append(path)
        finally:
            os.close(fd)
    if removed and not dry_run and rmdir:
        try:
            os.rmdir(d)
            removed.append(d)
        except OSError:
            pass
    return removed


def _private_dir(path: str) -> None:
    """Make ``path`` a 0700 directory of this user, or refuse one that is not."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of this user with mode 0700 "
                              "(someone else made it?); remove it or pass --token-file")


class CurveServer:
    """CurveZMQ set-up of a server's ROUTER socket, and the ZAP handler when client keys
    are restricted.

    Parameters
    ----------
    secret_key_file : str
        The server's ``.key_secret`` file.
    allowed_clients : str, optional
        Directory of client ``.key`` files; when given, other client keys are refused.
        None: any key is let in (the server's config needs ``--curve-allow-any`` for
        that), each a principal of its own.
    context : zmq.Context
    """

    def __init__(self, secret_key_file: str, allowed_clients: str | None,
                 context: zmq.Context) -> None:
        self.public, self.secret = load_keypair(secret_key_file)
        self._auth: Any = None
        if allowed_clients is not None and not os.path.isdir(allowed_clients):
            raise ValueError(f"{allowed_clients} is not a directory of client keys")
        from zmq.auth.thread import ThreadAuthenticator

        # Always through ZAP, so that each message carries the client's key (User-Id):
        # the principal its limits are counted by.
        self._auth = ThreadAuthenticator(context, log=log)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=allowed_clients
                                   if allowed_clients is not None else zmq.auth.CURVE_ALLOW_ANY)

    def setup(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
