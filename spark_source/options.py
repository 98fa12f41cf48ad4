"""The data source's options, checked once when a query starts.

Names follow Spark's Kafka source where the idea is the same. Every option is checked
before anything is read: an unknown name or a malformed value fails with a message that
names the option, so a typo never silently becomes a default.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from quorumq.client.core import parse_endpoints


class OptionError(ValueError):
    """An option of the quorumq data source is unknown, missing or malformed."""


READ_OPTIONS = frozenset(
    {
        "endpoints",
        "queue",
        "token",
        "startingoffsets",
        "startingtimestamp",
        "endingoffsets",
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
WRITE_OPTIONS = frozenset({"endpoints", "queue", "token", "batchrows", "checkpointlocation"})
CAMEL_CASE = (
    "startingOffsets",
    "startingTimestamp",
    "endingOffsets",
    "maxOffsetsPerTrigger",
    "minOffsetsPerTrigger",
    "maxTriggerDelay",
    "failOnDataLoss",
    "includeHeaders",
    "groupIdPrefix",
    "readWaitSeconds",
    "batchRows",
    "checkpointLocation",
)
SPELLING = {
    name.lower(): name for name in ("endpoints", "queue", "token", "partitions", *CAMEL_CASE)
}
"""Option names as users write them (Spark hands them over case-insensitively)."""


@attrs.frozen(kw_only=True)
class ReadOptions:
    endpoints: tuple[str, ...]
    queue: str
    token: str | None = None
    starting_offsets: str | int = "latest"
    """"earliest", "latest" or an offset (streaming default "latest", batch "earliest")."""
    starting_timestamp: int | None = None
    """Milliseconds since the epoch: start at the first message enqueued at or after it."""
    ending_offsets: str | int = "latest"
    """Batch reads only: "latest" or an offset (exclusive)."""
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
    batch_rows: int = 500
    """Rows per `publish_batch` (one log entry each)."""


def _lower(options: Mapping[str, str], allowed: frozenset[str], what: str) -> dict[str, str]:
    found = {k.lower(): v for k, v in options.items()}
    unknown = sorted(k for k in options if k.lower() not in allowed)
    if unknown:
        known = ", ".join(sorted(SPELLING[a] for a in allowed))
        raise OptionError(f"unknown quorumq {what} option(s) {unknown}; known options: {known}")
    return found


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


def _offset_spec(
    found: dict[str, str], name: str, words: tuple[str, ...], default: str
) -> str | int:
    raw = found.get(name.lower())
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in words:
        return value
    try:
        offset = int(value)
    except ValueError:
        choices = ", ".join(words)
        raise OptionError(
            f"option {name!r} must be {choices} or an offset (a non-negative integer), got {raw!r}"
        ) from None
    if offset < 0:
        raise OptionError(f"option {name!r} must not be negative, got {offset}")
    return offset


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


def read_options(options: Mapping[str, str], *, batch: bool) -> ReadOptions:
    """Check a read's options; `batch` for `spark.read` (which may name an end)."""
    found = _lower(options, READ_OPTIONS, "read")
    default_start = "earliest" if batch else "latest"
    starting = _offset_spec(found, "startingOffsets", ("earliest", "latest"), default_start)
    ending = _offset_spec(found, "endingOffsets", ("latest",), "latest")
    if not batch and "endingoffsets" in found:
        raise OptionError("option 'endingOffsets' is for batch reads (spark.read) only")
    if batch:
        for name in ("maxOffsetsPerTrigger", "minOffsetsPerTrigger", "maxTriggerDelay"):
            if name.lower() in found:
                raise OptionError(f"option {name!r} is for streaming reads only")
        if starting == "latest":
            raise OptionError("option 'startingOffsets' cannot be latest in a batch read")
    timestamp = _int(found, "startingTimestamp", minimum=0)
    if timestamp is not None and "startingoffsets" in found:
        raise OptionError("give either 'startingOffsets' or 'startingTimestamp', not both")
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
        queue=_required(found, "queue"),
        token=found.get("token") or None,
        starting_offsets=starting,
        starting_timestamp=timestamp,
        ending_offsets=ending,
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
    """Check a sink's options."""
    found = _lower(options, WRITE_OPTIONS, "sink")
    batch_rows = _int(found, "batchRows", minimum=1)
    return WriteOptions(
        endpoints=_endpoints(found),
        queue=_required(found, "queue"),
        token=found.get("token") or None,
        batch_rows=500 if batch_rows is None else batch_rows,
    )
