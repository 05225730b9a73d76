"""Host names for the ``Host`` check (DNS-rebinding defence), with the standard library only, so the
command (which loads without the ``dashboard`` extra) and :class:`~.web.HostCheck` share them.

The rule: a ``Host`` that is an IP address is always answered, since rebinding needs a DNS name;
a name must be on the list. So the list holds names only, and an address on it would decide
nothing. How two names compare (:func:`host_key`) is applied in one place, by ``HostCheck``, to
its list and to each request's header alike.
"""

from __future__ import annotations

import ipaddress

# The loopback name every dashboard answers to: no page of another site can make a browser send
# ``Host: localhost`` (a DNS name it controls never resolves as ``localhost``).
LOOPBACK_NAMES = ("localhost",)


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def ip_literal(value: str) -> bool:
    """``value`` is an IP address (an IPv6 one bare or in brackets), not a DNS name."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        return _is_ipv6(text[1:-1])
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def host_key(value: str) -> str:
    """A host as the check compares it: without surrounding whitespace, case or a final dot
    (``Ops.Example.com.`` is the same DNS name as ``ops.example.com``), and an IPv6 address without
    its brackets. Brackets around anything else are kept, so ``[ops.example.com]`` (which no URL
    can hold) never matches the name inside."""
    text = value.strip().lower()
    if text.startswith("[") and text.endswith("]") and _is_ipv6(text[1:-1]):
        return text[1:-1]
    return text.removesuffix(".")


def host_of_header(header: str) -> str:
    """The :func:`host_key` of a ``Host`` header, without its port: ``[::1]:8080`` -> ``::1``,
    ``Ops.Example.com.:443`` -> ``ops.example.com``."""
    text = header.strip()
    if text.startswith("["):
        end = text.find("]")
        name = text[: end + 1] if end >= 0 else text
    else:
        name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    return host_key(name)
