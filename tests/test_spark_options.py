"""Option checking of the Spark source and sink, without a JVM: every bad option fails
with a message that names it."""

from __future__ import annotations

import pytest

from spark_source.options import (
    OptionError,
    ReadOptions,
    check_options,
    read_options,
    write_options,
)

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
        ({"topic": "x"}, False, "option 'topic' is a sink option, not a read one"),
        ({"maxOffsetPerTrigger": "1"}, False, "(did you mean 'maxOffsetsPerTrigger'?)"),
        ({"endingTimestamp": "5"}, False, "'endingTimestamp' is for batch reads"),
        ({"subscribe": "orders"}, False, "options 'queue' and 'subscribe' mean the same"),
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
    with pytest.raises(OptionError, match="option 'startingOffsets' is a read option, not a sink"):
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


KAFKA_BASE = {"kafka.bootstrap.servers": "127.0.0.1:7001,127.0.0.1:7002", "subscribe": "orders"}


def test_kafka_names_of_the_same_options_are_taken() -> None:
    options = read_options(
        {**KAFKA_BASE, "minPartitions": "3", "startingOffsetsByTimestamp": '{"orders": {"0": 7}}'},
        batch=False,
    )
    assert options == ReadOptions(
        endpoints=("127.0.0.1:7001", "127.0.0.1:7002"),
        queue="orders",
        partitions=3,
        starting_timestamp=7,
    )
    sink = write_options({"kafka.bootstrap.servers": "127.0.0.1:7001", "topic": "orders"})
    assert (sink.endpoints, sink.queue) == (("127.0.0.1:7001",), "orders")
    with pytest.raises(OptionError, match="option 'subscribe' is a read option, not a sink one"):
        write_options(KAFKA_BASE)


@pytest.mark.parametrize(
    ("name", "json_form", "batch", "meaning"),
    [
        ("startingOffsets", {"0": 23, "1": 23, "2": 23}, False, 23),
        ("startingOffsets", {"0": -2, "1": -2}, False, "earliest"),
        ("startingOffsets", {"0": -1}, False, "latest"),
        ("endingOffsets", {"0": 40, "1": 40}, True, 40),
        ("endingOffsets", {"0": -1}, True, "latest"),
    ],
)
def test_kafkas_json_offsets_map_when_every_partition_has_the_same(
    name: str, json_form: dict[str, int], batch: bool, meaning: str | int
) -> None:
    import json

    options = read_options({**KAFKA_BASE, name: json.dumps({"orders": json_form})}, batch=batch)
    assert getattr(
        options, "starting_offsets" if name == "startingOffsets" else "ending_offsets"
    ) == (meaning)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"startingOffsets": '{"orders": {"0": 23, "1": -2}}'},
            "gives its partitions ['-2', '23']: a quorumq queue is one log",
        ),
        ({"startingOffsets": '{"payments": {"0": 3}}'}, "names ['payments'], but this query"),
        ({"startingOffsets": '{"orders": [0, 1]}'}, 'in JSON must be {"orders": {"0": <value>'),
        ({"startingOffsets": '{"orders": {"0": 1'}, "option 'startingOffsets' is not valid JSON"),
        ({"endingOffsets": '{"orders": {"0": -2}}'}, "'endingOffsets' must not be negative"),
    ],
)
def test_kafkas_json_offsets_that_do_not_map_are_refused(
    extra: dict[str, str], message: str
) -> None:
    with pytest.raises(OptionError) as caught:
        read_options({**KAFKA_BASE, **extra}, batch=True)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("assign", "Kafka's option 'assign' has no quorumq equivalent: a quorumq source reads"),
        ("kafka.group.id", "Kafka's option 'kafka.group.id' has no quorumq equivalent"),
        ("maxRecordsPerPartition", "(a key bucket) is never split"),
        ("kafka.sasl.mechanism", "'kafka.sasl.mechanism' is a Kafka client setting"),
    ],
)
def test_kafka_options_without_a_quorumq_meaning_are_refused_saying_why(
    name: str, message: str
) -> None:
    with pytest.raises(OptionError) as caught:
        check_options({**KAFKA_BASE, name: "x"})
    assert message in str(caught.value)


def test_what_is_checked_when_spark_makes_the_source() -> None:
    """Names and values, before Spark says whether it reads or writes, in batch or not:
    a misspelt name, a malformed value and options of both sides fail; an option of one
    kind of read is left for the reader to judge."""
    with pytest.raises(OptionError, match=r"\['batchrow'\] \(did you mean 'batchRows'\?\)"):
        check_options({**BASE, "batchRow": "10"})
    with pytest.raises(OptionError, match="'maxOffsetsPerTrigger' must be an integer"):
        check_options({**BASE, "maxOffsetsPerTrigger": "ten"})
    with pytest.raises(OptionError, match=r"\['batchRows'\] for the sink: give one side's"):
        check_options({**BASE, "maxOffsetsPerTrigger": "10", "batchRows": "5"})
    check_options({**BASE, "endingOffsets": "10"})  # fine for spark.read
    check_options({**BASE, "maxOffsetsPerTrigger": "10"})  # fine for readStream
    check_options({**KAFKA_BASE, "maxOffsetsPerTrigger": "10"})


def test_tls_options_and_kafkas_names_for_them(tmp_path: object) -> None:
    """A cluster that serves TLS is read and written with `tls` and `tlsCaFile`, or
    Kafka's `kafka.security.protocol=SSL` and a PEM truststore; what cannot map (a JKS
    truststore, SASL) is refused saying why."""
    from pathlib import Path

    ca = Path(str(tmp_path)) / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert read_options(BASE, batch=True).tls is None
    assert read_options({**BASE, "tls": "true"}, batch=True).tls is True
    assert read_options({**BASE, "tlsCaFile": str(ca)}, batch=True).tls == str(ca)
    assert write_options({**BASE, "tls": "true", "tlsCaFile": str(ca)}).tls == str(ca)
    kafka = {
        **KAFKA_BASE,
        "kafka.security.protocol": "SSL",
        "kafka.ssl.truststore.location": str(ca),
        "kafka.ssl.truststore.type": "PEM",
    }
    assert read_options(kafka, batch=True).tls == str(ca)
    assert (
        read_options({**KAFKA_BASE, "kafka.security.protocol": "PLAINTEXT"}, batch=True).tls is None
    )
    for extra, message in (
        ({"kafka.ssl.truststore.type": "JKS"}, "only as PEM"),
        ({"kafka.security.protocol": "SASL_SSL"}, "not SASL"),
        ({"tls": "maybe"}, "must be true or false"),
        ({"tlsCaFile": str(ca) + ".missing"}, "cannot read"),
        ({"tls": "false", "tlsCaFile": str(ca)}, "'tls' is false"),
        ({"tls": "true", "kafka.security.protocol": "SSL"}, "mean the same"),
        ({"tlsCaFile": " "}, "is empty"),
    ):
        with pytest.raises(OptionError, match=message):
            read_options({**KAFKA_BASE, **extra}, batch=True)
    (tmp := Path(str(tmp_path)) / "not.pem").write_text("hello")
    with pytest.raises(OptionError, match="no PEM certificate"):
        write_options({**BASE, "tlsCaFile": str(tmp)})
