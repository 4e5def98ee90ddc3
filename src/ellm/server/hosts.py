"""Host names as `ellm serve` prints and judges them (shared by the single-process and
the Ray Serve entry points)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether host is reachable only from this machine (serving elsewhere wants a key)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """host as it appears in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
