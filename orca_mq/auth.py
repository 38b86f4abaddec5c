"""Who may use a server: API keys (HTTP and ZeroMQ) and CurveZMQ encryption of the client port.

Keys (`server.api_key`, comma-separated; $ORCA_MQ_API_KEY; `--api-key`) are compared in constant
time, every configured key each time, and never logged; the launcher hands them to its children in
the environment, never on a command line. CurveZMQ (libzmq's CURVE, keys made by pyzmq's
`zmq.auth`): the broker's client socket is a CURVE server with the secret key file
`server.curve_secret_key`; a client needs the matching public key (`server_key`) and brings a
fresh key pair of its own: frames are encrypted and the client knows it talks to that server. Who
the client is stays the API key's business.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

import zmq

Z85_KEY_CHARS = 40


class KeyCheck:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def ok(self, key: str | None) -> bool:
        """True when no key is required or `key` is one of them (every key compared, in constant time)."""
        return not self._keys or self.which(key) >= 0

    def which(self, key: str | None) -> int:
        """The index of the key `key` is (-1: none), every key compared, in constant time."""
        given = (key or "").encode("utf-8", "replace")
        hits = [hmac.compare_digest(given, k) for k in self._keys]
        return hits.index(True) if any(hits) else -1


def create_keys(directory: str | Path) -> tuple[Path, Path]:
    """A CurveZMQ key pair for a server: (public file for clients, secret file for server.curve_secret_key)."""
    import zmq.auth

    directory = Path(directory).expanduser()
    if (directory / "server.key_secret").exists():
        raise FileExistsError(f"{directory} holds a key pair already (a server may use it): remove it first")
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), "server")
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _certificate(path: str) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not zmq.has("curve"):
        raise ValueError("this libzmq has no CURVE support")
    try:
        return zmq.auth.load_certificate(str(Path(path).expanduser()))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CurveZMQ key file {path}: {e}") from None


def server_keys(secret_file: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret key file (`orca-mq keys`); ValueError with one line if it is not one."""
    public, secret = _certificate(secret_file)
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key (give the .key_secret file made by `orca-mq keys`)")
    return public, secret


def public_key(server_key: str) -> bytes:
    """A server's public key: its 40-character Z85 text, or a key file (public or secret) holding it."""
    if len(server_key) == Z85_KEY_CHARS and not Path(server_key).exists():
        return server_key.encode()
    return _certificate(server_key)[0]


def curve_server(sock: zmq.Socket[Any], secret_file: str) -> None:
    """Make `sock` (before it binds) a CURVE server with the key pair in `secret_file`."""
    sock.curve_publickey, sock.curve_secretkey = server_keys(secret_file)
    sock.curve_server = True


def curve_client(sock: zmq.Socket[Any], server_key: str) -> None:
    """Make `sock` (before it connects) a CURVE client of the server whose public key is `server_key`."""
    sock.curve_serverkey = public_key(server_key)
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
