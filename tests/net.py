"""A free TCP port on 127.0.0.1 (for the servers tests start; nothing else imported, so any test helper
or benchmark can use it without the fixtures' imports)."""

from __future__ import annotations

import socket


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
