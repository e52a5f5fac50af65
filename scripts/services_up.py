"""Exit 0 when the PostgreSQL and Redis URLs given on the command line both answer."""

from __future__ import annotations

import socket
import sys
from urllib.parse import urlparse


def answers(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=2):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(0 if all(answers(url) for url in sys.argv[1:]) else 1)
