"""URLs without their secrets, for logs, reprs and errors. Pure: no I/O library.

Redaction reads a URL with the same rules as the client that connects with it:
yarl for AMQP URLs (what aio-pika and aiormq parse), PyMongo's URI rules for
MongoDB URIs. A password may hold ``@`` or ``:``: cutting at the first ``@``
would leave most of it on show.
"""

from __future__ import annotations

import contextlib
import urllib.parse

from yarl import URL

from ._nodes import NodeList

__all__ = ["redact_url", "scrub"]

_MASK = "***"
_MONGO_SCHEMES = ("mongodb://", "mongodb+srv://")
# MongoDB URI options whose values are secrets (compared case-insensitively, as PyMongo does).
_MONGO_SECRET_OPTIONS = frozenset({"tlscertificatekeyfilepassword", "authmechanismproperties"})


def redact_url(url: str) -> str:
    """``url`` with its password (and secret options) replaced by ``***``, for logs, reprs and errors."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}, not a URL>"
    if url.lower().startswith(_MONGO_SCHEMES):
        return _redact_mongo(url)
    return _redact_amqp(url)


def _redact_amqp(url: str) -> str:
    if "," in url:
        with contextlib.suppress(ValueError):
            nodes = NodeList.parse(url)
            if len(nodes.hosts) > 1:  # yarl refuses a host list: redact its first node's URL, keep the hosts
                first = NodeList.parse(_redact_amqp(nodes.node(nodes.hosts[0])))
                return first.node(",".join(nodes.hosts))
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return _redact_opaque(url)
    return url if parsed.password is None else str(parsed.with_password(_MASK))


def _redact_mongo(url: str) -> str:
    # PyMongo's rules: the options start at the first '?', the database at the first '/'
    # before them, and the user information ends at the LAST '@' of the host part.
    scheme, _, rest = url.partition("://")
    host_and_db, question, options = rest.partition("?")
    host_part, slash, database = host_and_db.partition("/")
    userinfo, at, hosts = host_part.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.partition(":")[0]
        host_part = f"{user}:{_MASK}@{hosts}" if "@" not in user else f"{_MASK}@{hosts}"
    if options:
        options = "&".join(_redact_option(option) for option in options.split("&"))
    return f"{scheme}://{host_part}{slash}{database}{question}{options}"


def _redact_option(option: str) -> str:
    name, equals, _ = option.partition("=")
    return f"{name}={_MASK}" if equals and name.lower() in _MONGO_SECRET_OPTIONS else option


def _redact_opaque(url: str) -> str:
    """A URL its parser refuses: keep the scheme and what follows the last '@', hide the rest."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _MASK
    return f"{scheme}://{_MASK}@{rest.rpartition('@')[2]}" if "@" in rest else url


def scrub(text: str, url: str) -> str:
    """``text`` (an error message from a client library) without ``url``'s password in any spelling."""
    if not url:
        return text
    redacted = redact_url(url)
    if url in text:
        # The URL shown redacted, and the password masked everywhere else.
        return redacted.join(scrub(part, url) for part in text.split(url))
    secrets: set[str] = set()
    if url.lower().startswith(_MONGO_SCHEMES):
        userinfo = url.partition("://")[2].partition("?")[0].partition("/")[0].rpartition("@")[0]
        if ":" in userinfo:
            secrets.add(userinfo.partition(":")[2])
    else:
        with contextlib.suppress(ValueError, TypeError):
            password = URL(url).password
            if password:
                secrets.add(password)
    for secret in list(secrets):
        secrets.update({urllib.parse.quote(secret, safe=""), urllib.parse.unquote_plus(secret)})
    parts = text.split(redacted) if redacted in text else [text]
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        parts = [part.replace(secret, _MASK) for part in parts]
    return redacted.join(parts)
