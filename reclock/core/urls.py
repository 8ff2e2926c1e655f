"""URLs that carry credentials (``scheme://user:password@host:port/path``):
a strict check for configuration, the password out of one, and one for
display with the password masked.

Parsers disagree about a URL whose password holds a reserved character. In
``postgresql://app:S3cr#t/p@ss@host/db`` libpq finds host ``app``, port
``S3cr#t`` and database ``p@ss@host/db``, then fails to connect, and every
message that names the server quotes the password. :func:`check_url`
therefore accepts only URLs every parser reads alike: reserved characters in
the user or password percent-encoded. Its messages never quote the URL: they
say what is wrong and show the fix with placeholders.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from reclock.core.secrets import Secret

#: The fix for a password with reserved characters, shown with placeholders
#: (a URL with a password in a message would be masked on its way out).
PERCENT_HINT = (
    "write {scheme}://user:password@host{port}/{path} with reserved characters of the "
    "user and password percent-encoded: '#' as %23, '/' as %2F, '@' as %40, ':' as %3A, "
    "'?' as %3F, '%' as %25, a space as %20 (a password a@b/c#d is written "
    "a%40b%2Fc%23d; one from an environment variable must hold the encoded form)"
)

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# What RFC 3986 allows unencoded in a URL, besides letters and digits (gen-
# and sub-delimiters, unreserved marks, '%' of an escape). '#' is not among
# them: no URL reclock takes has a fragment, and a '#' there is a password's.
_ALLOWED = frozenset("-._~!$&'()*+,;=:/?@[]%")
_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


@dataclass(frozen=True)
class UrlParts:
    """A URL as :func:`check_url` read it (user and password decoded)."""

    scheme: str
    user: str | None
    password: str | None
    hosts: tuple[tuple[str, int | None], ...]
    path: str
    query: str


def check_url(url: str, schemes: tuple[str, ...], *, what: str = "URL",
              multi_host: bool = False, host_required: bool = True,
              path_slashes: bool = True, example: str = "host:port/path") -> UrlParts:
    """``url`` parsed strictly, or a ``ValueError`` whose message names the
    problem and the fix without quoting ``url``.

    ``schemes``: the accepted schemes (lower case); ``multi_host``: the host
    part may list ``host:port`` pairs separated by commas (libpq);
    ``host_required``: an empty host is an error; ``path_slashes``: the path
    may hold more than its leading ``/`` (not a database name);
    ``example``: what follows ``user:password@`` in the hint's example.
    """
    head, sep, rest = url.partition("://")
    if not sep or not _SCHEME.fullmatch(head):
        raise ValueError(f"{what} is not a URL (expected {schemes[0]}://{example})")
    scheme = head.lower()
    if scheme not in schemes:
        raise ValueError(f"{what} has an unsupported scheme {scheme!r} "
                         f"(expected {' or '.join(s + '://' for s in schemes)})")
    hint = _hint(scheme, example)
    for ch in rest:
        if ch.isspace() or (ch.isascii() and not ch.isalnum() and ch not in _ALLOWED):
            raise ValueError(f"{what} holds a character that is not allowed in a URL "
                             f"(such as a space, '#', a quote or a control character); {hint}")
    if "%" in rest and len(_ESCAPE.findall(rest)) != rest.count("%"):
        raise ValueError(f"{what} holds a '%' that does not start an escape such as %40; "
                         f"{hint}")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if authority.count("@") > 1:
        raise ValueError(f"{what} has more than one '@' before its host; {hint}")
    userinfo, at, hostpart = authority.rpartition("@")
    user = password = None
    if at:
        u, colon, p = userinfo.partition(":")
        user = urllib.parse.unquote(u)
        password = urllib.parse.unquote(p) if colon else None
    path, _, query = tail.partition("?")
    if "@" in path or any("@" in item.partition("=")[0] for item in query.split("&")):
        raise ValueError(f"{what} has an '@' after its host, so its password was cut at a "
                         f"'/' or '?'; {hint}")
    if not path_slashes and "/" in path[1:]:
        raise ValueError(f"{what} names a database holding '/', so its password was cut "
                         f"at a '/'; {hint}")
    hosts = tuple(_host(h, what, hint) for h in (hostpart.split(",") if multi_host
                                                  else [hostpart]))
    if host_required and not all(h for h, _ in hosts):
        raise ValueError(f"{what} names no host (expected {scheme}://{example})")
    return UrlParts(scheme, user, password, hosts, path, query)


def _hint(scheme: str, example: str) -> str:
    host, _, path = example.partition("/")
    port = host[len("host"):] if host.startswith("host") else ""
    return PERCENT_HINT.format(scheme=scheme, port=port, path=path)


def _host(spec: str, what: str, hint: str) -> tuple[str, int | None]:
    """``host[:port]`` or ``[v6]:port`` -> (host, port)."""
    if spec.startswith("["):
        close = spec.find("]")
        if close < 0:
            raise ValueError(f"{what} has a '[' without its ']' around an IPv6 address")
        host, rest = spec[1:close], spec[close + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{what} has text after an IPv6 address's ']'; {hint}")
        port = rest[1:] if rest else None
    else:
        host, colon, p = spec.partition(":")
        port = p if colon else None
        if "[" in host or "]" in host:
            raise ValueError(f"{what} has a '[' or ']' outside an IPv6 address; {hint}")
    if port is None or port == "":
        return host, None
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} has a port that is not a number from 1 to 65535 (a "
                         f"password holding ':', '/' or '@' splits the URL early); {hint}")
    return host, int(port)


def url_password(url: str) -> str | None:
    """The password in ``url``'s user part (decoded), or None. Lenient: for
    URLs that may not have been checked, the user part ends at the last
    ``@`` before the path."""
    _, sep, rest = url.partition("://")
    if not sep:
        return None
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    userinfo, at, _ = rest[:end].rpartition("@")
    if not at or ":" not in userinfo:
        return None
    return urllib.parse.unquote(userinfo.partition(":")[2]) or None


def url_secrets(url: str) -> list[str]:
    """What to scrub for ``url``: its password as written and decoded, and
    the values of ``password=``-like query parameters."""
    out: list[str] = []
    _, sep, rest = url.partition("://")
    if not sep:
        return out
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    userinfo, at, _ = rest[:end].rpartition("@")
    if at and ":" in userinfo:
        raw = userinfo.partition(":")[2]
        out += [raw, urllib.parse.unquote(raw)]
    query = rest.partition("?")[2]
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=False):
        if "pass" in key.lower() or "secret" in key.lower() or "token" in key.lower():
            out.append(value)
    return [s for s in out if s]


def mask_url(url: str) -> str:
    """``url`` with its password (and ``password=``-like query values)
    replaced by ``***``, for display."""
    head, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    userinfo, at, hostpart = rest[:end].rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.partition(':')[0]}:***@{hostpart}{rest[end:]}"
    base, q, query = rest.partition("?")
    if q:
        parts = []
        for item in query.split("&"):
            key, eq, _value = item.partition("=")
            low = key.lower()
            secret = "pass" in low or "secret" in low or "token" in low
            parts.append(f"{key}=***" if eq and secret else item)
        rest = f"{base}?{'&'.join(parts)}"
    return f"{head}://{rest}"


#: A setting holding a URL whose password (and ``password=`` parameters) is secret.
URL_SECRET = Secret(lambda v: url_secrets(v) if isinstance(v, str) else [],
                    lambda v: mask_url(v) if isinstance(v, str) else v)
