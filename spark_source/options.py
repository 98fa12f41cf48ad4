"""The data source's options, checked once when a query starts.

Names follow Spark's Kafka source where the idea is the same. Every option is checked
before anything is read: an unknown name or a malformed value fails with a message that
names the option, so a typo never silently becomes a default.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping

import attrs

from quorumq.client.core import parse_endpoints


class OptionError(ValueError):
    """An option of the quorumq data source is unknown, missing or malformed."""


CONNECTION_OPTIONS = frozenset({"tls", "tlscafile", "kafka.ssl.truststore.type"})
"""How both sides connect, besides `endpoints` and `token`: TLS (`tls`, `tlsCaFile`;
Kafka's `kafka.security.protocol` and PEM truststore settings are taken too)."""
READ_OPTIONS = CONNECTION_OPTIONS | frozenset(
    {
        "endpoints",
        "queue",
        "token",
        "startingoffsets",
        "startingtimestamp",
        "endingoffsets",
        "endingtimestamp",
        "maxoffsetspertrigger",
        "minoffsetspertrigger",
        "maxtriggerdelay",
        "partitions",
        "failondataloss",
        "includeheaders",
        "groupidprefix",
        "readwaitseconds",
    }
)
WRITE_OPTIONS = CONNECTION_OPTIONS | frozenset(
    {"endpoints", "queue", "token", "batchrows", "checkpointlocation"}
)
CAMEL_CASE = (
    "startingOffsets",
    "startingTimestamp",
    "endingOffsets",
    "endingTimestamp",
    "maxOffsetsPerTrigger",
    "minOffsetsPerTrigger",
    "maxTriggerDelay",
    "failOnDataLoss",
    "includeHeaders",
    "groupIdPrefix",
    "readWaitSeconds",
    "tlsCaFile",
    "batchRows",
    "checkpointLocation",
)
KAFKA_CONNECTION_NAMES = {
    "kafka.security.protocol": "tls",
    "kafka.ssl.truststore.location": "tlscafile",
}
"""Kafka client settings that mean what one of ours means (values: `SSL` or
`PLAINTEXT`; a truststore only as PEM, `kafka.ssl.truststore.type=PEM`)."""
KAFKA_READ_NAMES = {
    **KAFKA_CONNECTION_NAMES,
    "kafka.bootstrap.servers": "endpoints",
    "subscribe": "queue",
    "minpartitions": "partitions",
    "startingoffsetsbytimestamp": "startingtimestamp",
    "endingoffsetsbytimestamp": "endingtimestamp",
}
"""Kafka source options that mean what one of ours means, and which of ours. (Kafka's
other names that have the same meaning are ours already: startingOffsets, ...)"""
KAFKA_WRITE_NAMES = {
    **KAFKA_CONNECTION_NAMES,
    "kafka.bootstrap.servers": "endpoints",
    "topic": "queue",
}
"""Kafka sink options that mean what one of ours means."""
SPELLING = {
    name.lower(): name
    for name in (
        "endpoints",
        "queue",
        "token",
        "partitions",
        *CAMEL_CASE,
        "kafka.bootstrap.servers",
        "subscribe",
        "minPartitions",
        "startingOffsetsByTimestamp",
        "endingOffsetsByTimestamp",
        "topic",
        "tls",
        "kafka.security.protocol",
        "kafka.ssl.truststore.location",
        "kafka.ssl.truststore.type",
    )
}
"""Option names as users write them (Spark hands them over in lower case)."""
KAFKA_ONLY = {
    "assign": "a quorumq source reads one whole queue: name it with 'subscribe' (or "
    "'queue'); 'partitions' sets how many key buckets it is split into",
    "subscribepattern": "a quorumq source reads one queue: name it with 'subscribe' (or 'queue')",
    "maxrecordsperpartition": "a quorumq input partition (a key bucket) is never split, so "
    "that each key's messages stay in order",
    "kafka.group.id": "quorumq records a query's progress under a group made from "
    "'groupIdPrefix' and the checkpoint",
    "kafkaconsumer.polltimeoutms": "the nearest quorumq option is 'readWaitSeconds' (how "
    "long a lagging replica may take to apply a range)",
    "fetchoffset.numretries": "a quorumq read asks the next node by itself",
    "fetchoffset.retryintervalms": "a quorumq read asks the next node by itself",
    "startingoffsetsbytimestampstrategy": "quorumq starts at the first message enqueued at "
    "or after the timestamp, or at the end when there is none",
}
"""Kafka options with no quorumq meaning, and why: refused, with that reason."""


def _name_error(name: str, allowed: frozenset[str], what: str) -> OptionError:
    """Why `name` is not an option of this side: Kafka's without equivalent, the other
    side's, or unknown (with the nearest known name)."""
    if name in KAFKA_ONLY:
        return OptionError(
            f"Kafka's option {SPELLING.get(name, name)!r} has no quorumq "
            f"equivalent: {KAFKA_ONLY[name]}"
        )
    if name.startswith("kafka."):
        return OptionError(
            f"option {name!r} is a Kafka client setting; a quorumq {what} connects with "
            "'endpoints' (or 'kafka.bootstrap.servers'), 'token', and for TLS 'tls' and "
            "'tlsCaFile' (or 'kafka.security.protocol' SSL and a PEM "
            "'kafka.ssl.truststore.location')"
        )
    other = (READ_OPTIONS | set(KAFKA_READ_NAMES)) ^ (WRITE_OPTIONS | set(KAFKA_WRITE_NAMES))
    if name in other:
        side = "sink" if what == "read" else "read"
        return OptionError(
            f"option {SPELLING.get(name, name)!r} is a {side} option, not a {what} one"
        )
    known = sorted(SPELLING[a] for a in allowed if a in READ_OPTIONS | WRITE_OPTIONS)
    near = difflib.get_close_matches(name, [k.lower() for k in known], n=1, cutoff=0.75)
    hint = f" (did you mean {SPELLING[near[0]]!r}?)" if near else ""
    return OptionError(
        f"unknown quorumq {what} option(s) [{name!r}]{hint}; known options: {', '.join(known)}"
    )


def _canonical(
    options: Mapping[str, str], allowed: frozenset[str], kafka: Mapping[str, str], what: str
) -> dict[str, str]:
    """The options by their quorumq name in lower case, Kafka's names translated; an
    option that is not one of this side's fails, naming it."""
    found: dict[str, str] = {}
    given: dict[str, str] = {}
    for key, value in options.items():
        name = key.lower()
        ours = kafka.get(name, name)
        if ours not in allowed:
            raise _name_error(name, allowed, what)
        if ours in found:
            raise OptionError(
                f"options {SPELLING.get(given[ours], given[ours])!r} and "
                f"{SPELLING.get(name, name)!r} mean the same: give one"
            )
        found[ours], given[ours] = value, name
    return found


TLS = bool | str | None
"""How a client connects: None or False (plain TCP), True (TLS, the system's CAs), or a
CA file (PEM) to trust."""


def _tls(found: dict[str, str]) -> TLS:
    """`tls` (true/false, or Kafka's SSL/PLAINTEXT) and `tlsCaFile` (a PEM file, which
    must be at the same path on the driver and every executor)."""
    raw = found.get("tls")
    ca = found.get("tlscafile")
    if ca is not None and not ca.strip():
        raise OptionError("option 'tlsCaFile' is empty: give the CA file's path, or leave it out")
    ca = ca.strip() if ca is not None else None
    kind = found.get("kafka.ssl.truststore.type")
    if kind is not None and kind.strip().upper() != "PEM":
        raise OptionError(
            f"option 'kafka.ssl.truststore.type' is {kind!r}: a quorumq client reads a "
            "truststore only as PEM (convert it: keytool -exportcert -rfc), then give "
            "'tlsCaFile' (or kafka.ssl.truststore.type=PEM)"
        )
    enabled: bool | None = None
    if raw is not None:
        value = raw.strip().lower()
        if value in ("true", "ssl"):
            enabled = True
        elif value in ("false", "plaintext"):
            enabled = False
        elif value.startswith("sasl"):
            raise OptionError(
                f"option 'kafka.security.protocol' {raw!r}: quorumq authenticates clients "
                "with 'token', not SASL; use SSL (with 'tlsCaFile') or PLAINTEXT"
            )
        else:
            raise OptionError(
                f"option 'tls' must be true or false (or SSL, PLAINTEXT), got {raw!r}"
            )
    if ca is not None:
        if enabled is False:
            raise OptionError("option 'tlsCaFile' is given but 'tls' is false")
        try:
            with open(ca, "rb") as f:
                pem = f.read(1 << 20)
        except OSError as e:
            raise OptionError(f"option 'tlsCaFile': cannot read {ca!r} ({e.strerror})") from None
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            raise OptionError(f"option 'tlsCaFile': {ca!r} holds no PEM certificate")
        return ca
    return True if enabled else None


@attrs.frozen(kw_only=True)
class ReadOptions:
    endpoints: tuple[str, ...]
    queue: str
    token: str | None = None
    tls: TLS = None
    """TLS to the nodes (`_tls`)."""
    starting_offsets: str | int = "latest"
    """"earliest", "latest" or an offset (streaming default "latest", batch "earliest")."""
    starting_timestamp: int | None = None
    """Milliseconds since the epoch: start at the first message enqueued at or after it."""
    ending_offsets: str | int = "latest"
    """Batch reads only: "latest" or an offset (exclusive)."""
    ending_timestamp: int | None = None
    """Batch reads only, milliseconds since the epoch: end before the first message
    enqueued at or after it."""
    max_offsets_per_trigger: int | None = None
    min_offsets_per_trigger: int | None = None
    max_trigger_delay_s: float = 15 * 60.0
    """With minOffsetsPerTrigger: run a smaller batch once new data waited this long."""
    partitions: int | None = None
    """Key buckets, one input partition each; None: the session's default parallelism."""
    fail_on_data_loss: bool = True
    include_headers: bool = False
    group_id_prefix: str = "spark-quorumq"
    read_wait_seconds: float = 10.0
    """How long a lagging replica may wait to apply a range before another is asked."""


@attrs.frozen(kw_only=True)
class WriteOptions:
    endpoints: tuple[str, ...]
    queue: str
    token: str | None = None
    tls: TLS = None
    """TLS to the nodes (`_tls`)."""
    batch_rows: int = 500
    """Rows per `publish_batch` (one log entry each)."""


def _required(found: dict[str, str], name: str) -> str:
    value = found.get(name.lower(), "").strip()
    if not value:
        raise OptionError(f"option {name!r} is required")
    return value


def _endpoints(found: dict[str, str]) -> tuple[str, ...]:
    raw = _required(found, "endpoints")
    try:
        parse_endpoints(raw)
    except ValueError as e:
        raise OptionError(f"option 'endpoints': {e}") from None
    return tuple(item.strip() for item in raw.split(","))


def _int(found: dict[str, str], name: str, *, minimum: int) -> int | None:
    raw = found.get(name.lower())
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise OptionError(f"option {name!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise OptionError(f"option {name!r} must be at least {minimum}, got {value}")
    return value


def _bool(found: dict[str, str], name: str, default: bool) -> bool:
    raw = found.get(name.lower())
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise OptionError(f"option {name!r} must be true or false, got {raw!r}")
    return value == "true"


def _kafka_json(raw: str, name: str, queue: str, words: Mapping[int, str]) -> str | int:
    """Kafka's JSON form, `{"<topic>": {"<partition>": <value>, ...}}`, where it maps: the
    topic is the queue, and every partition named has the same value (a queue is one
    log; its partitions are key buckets of it, all read from one offset). `words`: the
    negative values Kafka gives a meaning (-2 earliest, -1 latest)."""
    try:
        parsed = json.loads(raw)
    except ValueError as e:
        raise OptionError(f"option {name!r} is not valid JSON ({e}): {raw!r}") from None
    if not (isinstance(parsed, dict) and all(isinstance(v, dict) for v in parsed.values())):
        raise OptionError(
            f'option {name!r} in JSON must be {{"{queue}": {{"0": <value>, ...}}}}, got {raw!r}'
        )
    if set(parsed) != {queue}:
        raise OptionError(
            f"option {name!r} names {sorted(parsed)}, but this query reads queue {queue!r} only"
        )
    values = set(parsed[queue].values())
    if len(values) != 1 or not all(type(v) is int for v in values):
        raise OptionError(
            f"option {name!r} gives its partitions {sorted(map(str, values))}: a quorumq queue "
            "is one log whose partitions are key buckets of it, all read from one offset, so "
            "every partition named must have the same integer"
        )
    (value,) = values
    if value in words:
        return words[value]
    if value < 0:
        raise OptionError(f"option {name!r} must not be negative, got {value}")
    return int(value)


def _offset_spec(
    found: dict[str, str],
    name: str,
    words: tuple[str, ...],
    default: str,
    queue: str,
) -> str | int:
    """A word ("earliest", "latest"), an offset, or Kafka's JSON form of offsets."""
    raw = found.get(name.lower())
    if raw is None:
        return default
    value = raw.strip().lower()
    if value.startswith("{"):
        kafka_words = {-2: "earliest", -1: "latest"}
        return _kafka_json(raw, name, queue, {k: w for k, w in kafka_words.items() if w in words})
    if value in words:
        return value
    try:
        offset = int(value)
    except ValueError:
        choices = ", ".join(words)
        raise OptionError(
            f"option {name!r} must be {choices}, an offset (a non-negative integer) or "
            f"Kafka's JSON form, got {raw!r}"
        ) from None
    if offset < 0:
        raise OptionError(f"option {name!r} must not be negative, got {offset}")
    return offset


def _timestamp(found: dict[str, str], name: str, queue: str) -> int | None:
    """Epoch milliseconds, or Kafka's JSON form of them (…ByTimestamp options)."""
    raw = found.get(name.lower())
    if raw is not None and raw.strip().startswith("{"):
        stamp = _kafka_json(raw, name, queue, {})
        assert isinstance(stamp, int)
        return stamp
    return _int(found, name, minimum=0)


DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(found: dict[str, str], name: str, default: float) -> float:
    """Seconds from "500ms", "30s", "15m", "1h" (or plain seconds)."""
    raw = found.get(name.lower())
    if raw is None:
        return default
    text = raw.strip().lower()
    number, scale = text, 1.0
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit):
            number, scale = text[: -len(unit)], DURATION_UNITS[unit]
            break
    try:
        value = float(number) * scale
    except ValueError:
        value = -1.0
    if value < 0:
        raise OptionError(f"option {name!r} must be a duration such as 30s or 15m, got {raw!r}")
    return value


def read_options(options: Mapping[str, str], *, batch: bool | None) -> ReadOptions:
    """Check a read's options; `batch` for `spark.read` (which may name an end), None
    when not yet known (the rules of one kind of read are then left out). Kafka's names
    for the same options are taken too (`subscribe`, `kafka.bootstrap.servers`, ...)."""
    found = _canonical(options, READ_OPTIONS, KAFKA_READ_NAMES, "read")
    queue = _required(found, "queue")
    default_start = "earliest" if batch else "latest"
    starting = _offset_spec(found, "startingOffsets", ("earliest", "latest"), default_start, queue)
    ending = _offset_spec(found, "endingOffsets", ("latest",), "latest", queue)
    timestamp = _timestamp(found, "startingTimestamp", queue)
    ending_timestamp = _timestamp(found, "endingTimestamp", queue)
    if batch is False:
        for name in ("endingOffsets", "endingTimestamp"):
            if name.lower() in found:
                raise OptionError(f"option {name!r} is for batch reads (spark.read) only")
    if batch is True:
        for name in ("maxOffsetsPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay"):
            if name.lower() in found:
                raise OptionError(f"option {name!r} is for streaming reads only")
        if starting == "latest":
            raise OptionError("option 'startingOffsets' cannot be latest in a batch read")
    if timestamp is not None and "startingoffsets" in found:
        raise OptionError("give either 'startingOffsets' or 'startingTimestamp', not both")
    if ending_timestamp is not None and "endingoffsets" in found:
        raise OptionError("give either 'endingOffsets' or 'endingTimestamp', not both")
    if isinstance(starting, int) and isinstance(ending, int) and ending < starting:
        raise OptionError(f"option 'endingOffsets' ({ending}) is before startingOffsets")
    maximum = _int(found, "maxOffsetsPerTrigger", minimum=1)
    minimum = _int(found, "minOffsetsPerTrigger", minimum=1)
    if maximum is not None and minimum is not None and minimum > maximum:
        raise OptionError(
            f"option 'minOffsetsPerTrigger' ({minimum}) exceeds maxOffsetsPerTrigger ({maximum})"
        )
    wait = found.get("readwaitseconds", "10")
    try:
        read_wait = float(wait)
    except ValueError:
        raise OptionError(f"option 'readWaitSeconds' must be a number, got {wait!r}") from None
    if not 0 <= read_wait <= 30:
        raise OptionError(f"option 'readWaitSeconds' must be from 0 to 30, got {wait!r}")
    return ReadOptions(
        endpoints=_endpoints(found),
        queue=queue,
        token=found.get("token") or None,
        tls=_tls(found),
        starting_offsets=starting,
        starting_timestamp=timestamp,
        ending_offsets=ending,
        ending_timestamp=ending_timestamp,
        max_offsets_per_trigger=maximum,
        min_offsets_per_trigger=minimum,
        max_trigger_delay_s=_duration(found, "maxTriggerDelay", 15 * 60.0),
        partitions=_int(found, "partitions", minimum=1),
        fail_on_data_loss=_bool(found, "failOnDataLoss", True),
        include_headers=_bool(found, "includeHeaders", False),
        group_id_prefix=found.get("groupidprefix", "spark-quorumq"),
        read_wait_seconds=read_wait,
    )


def write_options(options: Mapping[str, str]) -> WriteOptions:
    """Check a sink's options (Kafka's `topic` and `kafka.bootstrap.servers` too)."""
    found = _canonical(options, WRITE_OPTIONS, KAFKA_WRITE_NAMES, "sink")
    batch_rows = _int(found, "batchRows", minimum=1)
    return WriteOptions(
        endpoints=_endpoints(found),
        queue=_required(found, "queue"),
        token=found.get("token") or None,
        tls=_tls(found),
        batch_rows=500 if batch_rows is None else batch_rows,
    )


def check_options(options: Mapping[str, str]) -> None:
    """What can be checked before it is known whether the source reads or writes, and
    whether in batch or streaming (when Spark makes the data source: at `load()`, at
    `start()` or `save()`): every name is an option of one side, and every value is
    well-formed. The rest is checked by `read_options` or `write_options`."""
    names = {k.lower() for k in options}
    read_names = READ_OPTIONS | frozenset(KAFKA_READ_NAMES)
    write_names = WRITE_OPTIONS | frozenset(KAFKA_WRITE_NAMES)
    for name in sorted(names):
        if name not in read_names | write_names:
            raise _name_error(name, READ_OPTIONS | WRITE_OPTIONS, "read or sink")
    read_only, write_only = sorted(names - write_names), sorted(names - read_names)
    if read_only and write_only:
        raise OptionError(
            f"options {[SPELLING[n] for n in read_only]} are for reading and "
            f"{[SPELLING[n] for n in write_only]} for the sink: give one side's"
        )
    if not write_only:
        read_options(options, batch=None)
    if not read_only:
        write_options(options)
