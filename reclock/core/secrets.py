"""Secrets: which settings hold one, and keeping their values out of every
text that leaves the process.

::

    configuration --(config_secrets: the literal value of every secret setting)--+
    S3 credentials resolved from AWS_* ---------------------------------------+  |
                                                                              v  v
    log records, health, progress.jsonl,                               SECRETS (Scrubber)
    status.json, /status.json, /readyz, ...  --(scrub)-->  text without them

What is a secret is data, not a guess from a key's spelling:

* librdkafka properties: the ones librdkafka itself marks sensitive
  (:data:`KAFKA_SENSITIVE_PROPERTIES`);
* Spark settings: what Spark's own ``spark.redaction.regex`` matches
  (:data:`SPARK_REDACTION`);
* reclock's own settings: the password of a DSN or URL (a Postgres or MariaDB
  DSN, the remap store, the schema registry's basic auth) and the fields typed
  :class:`~pydantic.SecretStr` (the S3 secret key and session token); each
  model says which of its fields hold one (:mod:`reclock.contracts.config`).

:class:`Scrubber` replaces each registered literal (as written, and as it
reads percent-encoded and decoded) with ``***``, and masks what still looks
like a credential in text nobody registered: ``scheme://user:***@host`` and
``password=***``. The process-wide :data:`SECRETS` is fed when a configuration
is loaded and applied where text leaves the process: a filter on the root
logger's handlers (:func:`install_log_filter`), the health and progress-log
writers and the status document.

Literals shorter than :data:`MIN_SECRET_LEN` characters are not replaced on
their own: replacing every ``a`` would garble every message and hide little.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: librdkafka's sensitive configuration properties: those its
#: ``src/rdkafka_conf.c`` flags ``_RK_SENSITIVE`` (redacted as ``[redacted]``
#: in its ``debug=conf`` dump, and wiped from memory once a client is made).
#: Taken from rdkafka_conf.c of librdkafka v2.14.0, v2.15.0 and master (the
#: same 13 in each), and checked against the installed librdkafka 2.16.0: its
#: own ``debug=conf`` dump redacts exactly these (``ssl_key`` is set through
#: the C API only; ``ssl.certificate.pem`` is public and not among them).
#: ``tests/reclock/test_secrets.py`` repeats that check on the installed one.
KAFKA_SENSITIVE_PROPERTIES: frozenset[str] = frozenset({
    "ssl.key.location",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.ca.pem",
    "ssl.keystore.password",
    "sasl.username",
    "sasl.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.assertion.private.key.file",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
})

#: Spark's own rule for which settings hold secrets: the default of
#: ``spark.redaction.regex`` in Spark 4.3 (``org.apache.spark.internal.config``),
#: which Spark applies to its UI and event logs.
SPARK_REDACTION = re.compile(r"(?i)secret|password|token|access[.]?key|credential")

#: Shorter literals are not scrubbed on their own (see the module docstring).
MIN_SECRET_LEN = 3

MASK = "***"


def is_sensitive_kafka_property(name: str) -> bool:
    """Whether librdkafka marks the property ``name`` sensitive."""
    return name.strip().lower() in KAFKA_SENSITIVE_PROPERTIES


def is_secret_spark_setting(name: str) -> bool:
    """Whether Spark would redact the setting ``name``."""
    return SPARK_REDACTION.search(name) is not None


def redact_kafka_properties(props: Mapping[str, Any]) -> dict[str, Any]:
    """``props`` with the value of every sensitive property replaced by ``***``."""
    return {k: (MASK if is_sensitive_kafka_property(str(k)) else v) for k, v in props.items()}


def kafka_secret_values(props: Mapping[str, Any]) -> list[str]:
    """The values of the sensitive properties in ``props``."""
    return [str(v) for k, v in props.items() if is_sensitive_kafka_property(str(k))]


def redact_spark_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with the value of every setting Spark would redact replaced by ``***``."""
    return {k: (MASK if is_secret_spark_setting(str(k)) else v) for k, v in conf.items()}


def spark_secret_values(conf: Mapping[str, Any]) -> list[str]:
    """The values of the settings in ``conf`` that Spark would redact."""
    return [str(v) for k, v in conf.items() if is_secret_spark_setting(str(k))]


@dataclass(frozen=True)
class Secret:
    """Field metadata saying that a setting holds secrets, e.g.
    ``dsn: Annotated[str, DSN_SECRET]``: ``values`` gives the literal secrets
    in a value (to scrub from text), ``shown`` the value for display (a URL
    with ``***`` for its password, properties with ``***`` for the sensitive
    ones). Configuration models mark their fields with it; fields typed
    :class:`~pydantic.SecretStr` are secrets whole."""

    values: Callable[[Any], Iterable[str]]
    shown: Callable[[Any], Any]


#: librdkafka properties (a mapping): the sensitive ones are secrets.
KAFKA_PROPERTIES = Secret(kafka_secret_values, redact_kafka_properties)
#: Spark settings (a mapping): those Spark redacts are secrets.
SPARK_CONF = Secret(spark_secret_values, redact_spark_conf)


# ---------------------------------------------------------------------------
# The scrubber
# ---------------------------------------------------------------------------

# Credentials in text that nobody registered (a URL quoted by a driver, a
# conninfo string): ``scheme://user:pw@`` and ``password=pw``.
# (the password runs to the last '@' before a '/' or a space: one holding an
# unencoded '@' is masked whole)
_URL_USERINFO = re.compile(r"(?P<pre>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<pw>[^/\s]*)@")
_SECRET_PARAM = re.compile(
    r"(?P<pre>(?:^|[?&;\s'\"])(?:password|passwd|pwd|sslpassword|secret|token|api_key)"
    r"\s*=\s*)('[^']*'|[^&;\s\"]*)",
    re.IGNORECASE,
)


def _forms(value: str) -> set[str]:
    """The ways ``value`` may appear in text: as written, decoded and
    percent-encoded (a URL holds its password encoded; a driver quotes it
    decoded)."""
    out = {value}
    with contextlib.suppress(UnicodeDecodeError):
        out.add(urllib.parse.unquote(value, errors="strict"))
    out.add(urllib.parse.quote(value, safe=""))
    out.add(urllib.parse.quote(value))  # ('/' kept)
    out.add(urllib.parse.quote(value, safe="!$&'()*+,;=:"))
    return {s for s in out if len(s) >= MIN_SECRET_LEN}


class Scrubber:
    """Literal secret values to remove from text, and the removal.

    Thread safe: :meth:`add` may run while other threads :meth:`scrub`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._literals: frozenset[str] = frozenset()
        self._pattern: re.Pattern[str] | None = None
        # the literals and their forms inside JSON text (quotes, backslashes
        # and non-ASCII characters escaped), for :meth:`hits`
        self._in_json: re.Pattern[str] | None = None

    def add(self, values: Iterable[str | None]) -> None:
        """Register secret values (each in every form :func:`_forms` gives)."""
        new: set[str] = set()
        for v in values:
            if v:
                new |= _forms(str(v))
        with self._lock:
            if new <= self._literals:
                return
            self._literals = self._literals | new
            # longest first: a secret that contains another is replaced whole
            alts = sorted(self._literals, key=lambda s: (-len(s), s))
            self._pattern = re.compile("|".join(re.escape(s) for s in alts))
            escaped = {json.dumps(s)[1:-1] for s in alts} | set(alts)
            self._in_json = re.compile("|".join(re.escape(s) for s in sorted(escaped)))

    def __len__(self) -> int:
        return len(self._literals)

    def literals(self) -> frozenset[str]:
        """Every registered value (in each of its forms), e.g. to ship to
        the executors with a job."""
        return self._literals

    def scrub(self, text: str, extra: Iterable[str] = ()) -> str:
        """``text`` without the registered secrets, without ``extra`` ones,
        and with URL passwords and ``password=`` values masked."""
        pattern = self._pattern
        if pattern is not None:
            text = pattern.sub(MASK, text)
        for s in extra:
            for form in _forms(s):
                text = text.replace(form, MASK)
        if "@" in text:
            text = _URL_USERINFO.sub(lambda m: f"{m['pre']}:{MASK}@", text)
        if "=" in text:
            text = _SECRET_PARAM.sub(lambda m: f"{m['pre']}{MASK}", text)
        return text

    def hits(self, text: str) -> bool:
        """Whether :meth:`scrub` would change ``text``, or a string inside
        ``text`` if it is JSON: a quick test, for text mostly clean."""
        found = self._in_json
        if found is not None and found.search(text):
            return True
        if "@" in text and _URL_USERINFO.search(text):
            return True
        return "=" in text and _SECRET_PARAM.search(text) is not None

    def scrub_json(self, value: Any) -> Any:
        """JSON-able ``value`` (objects as ``str`` makes them) scrubbed: the
        very value when none of its text needs it (one ``json.dumps`` to
        tell, far cheaper than visiting every number of a large frontier),
        else a plain copy with every string scrubbed."""
        text = json.dumps(value, separators=(",", ":"), default=str)
        if not self.hits(text):
            return value
        return self.scrub_data(json.loads(text))

    def scrub_data(self, value: Any) -> Any:
        """``value`` (JSON-like data) with every string scrubbed; mappings and
        lists are copied only where something changed."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            out = {k: self.scrub_data(v) for k, v in value.items()}
            return value if all(out[k] is value[k] for k in value) else out
        if isinstance(value, list | tuple):
            items = [self.scrub_data(v) for v in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value
            return items if isinstance(value, list) else tuple(items)
        return value


#: The process's secrets: fed by every configuration loaded
#: (:func:`reclock.config.schema.parse_config`) and by resolved S3 credentials.
SECRETS = Scrubber()


def register(values: Iterable[str | None]) -> None:
    """Add secret values to :data:`SECRETS`."""
    SECRETS.add(values)


def scrub(text: str, extra: Iterable[str] = ()) -> str:
    """``text`` scrubbed by :data:`SECRETS` (and of ``extra`` values)."""
    return SECRETS.scrub(text, extra)


def scrub_data(value: Any) -> Any:
    """JSON-like ``value`` with every string scrubbed by :data:`SECRETS`."""
    return SECRETS.scrub_data(value)


def scrub_json(value: Any) -> Any:
    """JSON-able ``value`` scrubbed by :data:`SECRETS` (see :meth:`Scrubber.scrub_json`)."""
    return SECRETS.scrub_json(value)


# ---------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------


class ScrubFilter(logging.Filter):
    """A handler filter that scrubs each record's message, exception and
    stack text before it is formatted (it never drops a record)."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it
            return True
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Put a :class:`ScrubFilter` on every handler of ``logger`` (default:
    the root logger) and on :data:`logging.lastResort`, once each: every
    record a handler writes is scrubbed, whichever logger it came from."""
    target = logger or logging.getLogger()
    handlers = list(target.handlers)
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for h in handlers:
        if not any(isinstance(f, ScrubFilter) for f in h.filters):
            h.addFilter(ScrubFilter())


__all__ = [
    "KAFKA_PROPERTIES", "KAFKA_SENSITIVE_PROPERTIES", "MASK", "MIN_SECRET_LEN", "SECRETS",
    "SPARK_CONF", "SPARK_REDACTION", "ScrubFilter", "Scrubber", "Secret", "install_log_filter",
    "is_secret_spark_setting", "is_sensitive_kafka_property", "kafka_secret_values",
    "redact_kafka_properties", "redact_spark_conf", "register", "scrub", "scrub_data",
    "scrub_json", "spark_secret_values",
]
