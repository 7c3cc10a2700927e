"""gRPC connections between dsaserve processes: TLS, keepalive, reconnects.

Without TLS settings the links are plaintext (a private network or loopback); with them every
server presents a certificate and every client verifies it against `--grpc-tls-ca`, and with
`--grpc-tls-require-client-cert` the servers also verify the clients' (mutual TLS), so the
cluster token never travels in the clear.

Keepalive: a client pings a connection that carries calls every few seconds and drops it when
a ping goes unanswered, so a hung peer (stopped, partitioned) fails its calls with UNAVAILABLE
within seconds instead of when the request's deadline runs out; servers accept such pings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from dsaserve.engine.config import setting

KEEPALIVE_TIME_MS = 4000  # ping an active connection this often...
KEEPALIVE_TIMEOUT_MS = 4000  # ...and drop it when a ping goes unanswered this long
MAX_MESSAGE_BYTES = 64 << 20

CLIENT_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # gRPC (1.85, measured) waits this long (default 60 s) for any ping's ack, keepalive's included,
    # whatever keepalive_timeout_ms says: without it a frozen peer is found after ~64 s.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # ping however long a stream waits for data
    # A restarted peer at the same address is reachable again within seconds.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
SERVER_OPTIONS = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for its keepalive pings
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass(frozen=True)
class GrpcTLS:
    """gRPC TLS"""

    cert: str | None = setting(
        None,
        "PEM certificate this process presents (server; client too for mTLS)",
        flag="--grpc-tls-cert",
    )
    key: str | None = setting(None, "PEM private key of --grpc-tls-cert", flag="--grpc-tls-key")
    ca: str | None = setting(
        None, "PEM CA bundle that peers' certificates must chain to", flag="--grpc-tls-ca"
    )
    require_client_cert: bool = setting(
        False,
        "servers accept only clients with a certificate from --grpc-tls-ca (mutual TLS)",
        flag="--grpc-tls-require-client-cert",
    )
    server_name: str | None = setting(
        None,
        "the name workers' certificates must carry (default: the host connected to); one "
        "certificate for workers whose addresses change (Kubernetes pods)",
        flag="--grpc-tls-server-name",
    )

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        if self.require_client_cert and self.ca is None:
            raise ValueError("--grpc-tls-require-client-cert needs --grpc-tls-ca")
        for path in (self.cert, self.key, self.ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @property
    def client_enabled(self) -> bool:
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: serve plaintext."""
        if self.cert is None:
            return None
        pair = [(_read(self.key), _read(self.cert))]
        if self.require_client_cert:
            return grpc.ssl_server_credentials(
                pair, root_certificates=_read(self.ca), require_client_auth=True
            )
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key = _read(self.key) if self.key else None
        cert = _read(self.cert) if self.cert else None
        return grpc.ssl_channel_credentials(_read(self.ca), key, cert)


def open_channel(address: str, tls: GrpcTLS) -> grpc.aio.Channel:
    """A channel to another dsaserve process (TLS when `--grpc-tls-ca` is set)."""
    if tls.client_enabled:
        options: tuple[tuple[str, int | str], ...] = CLIENT_OPTIONS
        if tls.server_name:
            options += (("grpc.ssl_target_name_override", tls.server_name),)
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)


def bind(server: grpc.aio.Server, address: str, tls: GrpcTLS) -> int:
    """Listen on `address` (TLS when `--grpc-tls-cert` is set); returns the port."""
    credentials = tls.server_credentials()
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def _read(path: str | None) -> bytes:
    assert path is not None
    return Path(path).read_bytes()
