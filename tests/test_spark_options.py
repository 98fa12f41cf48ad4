"""Option checking of the Spark source and sink, without a JVM: every bad option fails
with a message that names it."""

from __future__ import annotations

import pytest

from spark_source.options import OptionError, ReadOptions, read_options, write_options

BASE = {"endpoints": "127.0.0.1:7001,127.0.0.1:7002", "queue": "orders"}


def test_defaults_follow_the_kafka_source() -> None:
    stream = read_options(BASE, batch=False)
    assert stream == ReadOptions(endpoints=("127.0.0.1:7001", "127.0.0.1:7002"), queue="orders")
    assert read_options(BASE, batch=True).starting_offsets == "earliest"


def test_names_are_case_insensitive_as_spark_hands_them_over() -> None:
    options = read_options(
        {**BASE, "maxoffsetspertrigger": "10", "FAILONDATALOSS": "False"}, batch=False
    )
    assert (options.max_offsets_per_trigger, options.fail_on_data_loss) == (10, False)


@pytest.mark.parametrize(
    ("extra", "batch", "message"),
    [
        ({"topic": "x"}, False, "unknown quorumq read option(s) ['topic']"),
        ({"startingOffsets": "-3"}, False, "option 'startingOffsets' must not be negative"),
        ({"startingOffsets": "latest"}, True, "cannot be latest in a batch read"),
        ({"endingOffsets": "latest"}, False, "'endingOffsets' is for batch reads"),
        ({"maxOffsetsPerTrigger": "0"}, False, "'maxOffsetsPerTrigger' must be at least 1"),
        ({"maxOffsetsPerTrigger": "10"}, True, "'maxOffsetsPerTrigger' is for streaming"),
        (
            {"maxOffsetsPerTrigger": "10", "minOffsetsPerTrigger": "20"},
            False,
            "'minOffsetsPerTrigger' (20) exceeds maxOffsetsPerTrigger (10)",
        ),
        ({"startingOffsets": "9", "endingOffsets": "3"}, True, "'endingOffsets' (3) is before"),
        ({"startingTimestamp": "1", "startingOffsets": "0"}, False, "either 'startingOffsets'"),
        ({"partitions": "two"}, False, "option 'partitions' must be an integer"),
        ({"includeHeaders": "1"}, False, "option 'includeHeaders' must be true or false"),
        ({"readWaitSeconds": "99"}, False, "'readWaitSeconds' must be from 0 to 30"),
        ({"endpoints": "localhost"}, False, "option 'endpoints': endpoint 'localhost'"),
        ({"queue": ""}, False, "option 'queue' is required"),
    ],
)
def test_a_bad_read_option_is_named(extra: dict[str, str], batch: bool, message: str) -> None:
    with pytest.raises(OptionError) as caught:
        read_options({**BASE, **extra}, batch=batch)
    assert message in str(caught.value)


def test_a_bad_sink_option_is_named() -> None:
    assert write_options({**BASE, "batchRows": "50"}).batch_rows == 50
    with pytest.raises(
        OptionError, match=r"unknown quorumq sink option\(s\) \['startingOffsets'\]"
    ):
        write_options({**BASE, "startingOffsets": "earliest"})
    with pytest.raises(OptionError, match="option 'endpoints' is required"):
        write_options({"queue": "q"})


def test_min_offsets_per_trigger_waits_at_most_max_trigger_delay() -> None:
    from pyspark.sql.streaming.datasource import ReadMaxRows, ReadMinRows

    from spark_source.source import QuorumqStreamReader

    def reader(**extra: str) -> QuorumqStreamReader:
        options = read_options({**BASE, **extra}, batch=False)
        return QuorumqStreamReader(options, 2, None)  # type: ignore[arg-type]

    patient = reader(minOffsetsPerTrigger="10", maxTriggerDelay="1h")
    assert isinstance(patient.getDefaultReadLimit(), ReadMinRows)
    assert patient._enough(0, 5, 10) == 0  # too few: no batch yet
    assert patient._enough(0, 12, 10) == 12
    impatient = reader(minOffsetsPerTrigger="10", maxTriggerDelay="0s")
    assert impatient._enough(0, 5, 10) == 5  # waited long enough
    assert isinstance(reader(maxOffsetsPerTrigger="7").getDefaultReadLimit(), ReadMaxRows)
    with pytest.raises(OptionError, match="'maxTriggerDelay' must be a duration"):
        reader(maxTriggerDelay="soon")
