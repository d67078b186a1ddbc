"""Protocol rules as plain functions: no Redis, no HTTP."""

from __future__ import annotations

import base64
import random

import orjson
import pytest

from gateway.archive.segments import Segment, bucket_of, file_name, take
from gateway.protocol import caching, cursor, entries, notices, offsets, sse
from gateway.protocol.errors import ProtocolError
from gateway.protocol.headers import (
    is_text,
    is_true,
    parse_decimal,
    parse_expires_at,
    parse_expiry,
    parse_producer,
    validate_content_type,
)
from gateway.protocol.jsonmode import body_entries, json_body, split_messages, to_array, with_offset
from gateway.redis_io import durability, keys


class TestOffsets:
    def test_round_trip_and_string_order_matches_position_order(self) -> None:
        positions = [0, 5, 10, 99, 100, 10**12]
        tokens = [offsets.encode(p) for p in positions]
        assert [offsets.decode(t) for t in tokens] == positions
        assert sorted(tokens) == tokens
        assert offsets.encode(0) == offsets.ZERO == "0000000000000001_0000000000000000"
        assert offsets.encode(21) == "0000000000000001_0000000000000042"

    def test_an_offset_plus_one_reads_as_the_one_issued(self) -> None:
        # y-durable-streams' compactor reads from its snapshot offset + 1 in the last field.
        for position in (0, 1, 7, 4096, 10**12, offsets.MAX_POSITION):
            kind, value = offsets.encode(position).split("_")
            bumped = f"{kind}_{int(value) + 1:016d}"
            assert offsets.decode(bumped) == position
            if position < offsets.MAX_POSITION:
                assert bumped < offsets.encode(position + 1)

    def test_offsets_minted_before_format_1_still_read(self) -> None:
        assert offsets.decode("0000000000000000_0000000000000000") == 0
        assert offsets.decode("0000000000000000_0000000000000043") == 43
        assert "0000000000000000_9999999999999999" < offsets.encode(0)  # newer tokens sort after

    def test_positions_out_of_range(self) -> None:
        with pytest.raises(ValueError):
            offsets.encode(offsets.MAX_POSITION + 1)

    @pytest.mark.parametrize(
        "bad",
        [
            "",
            "abc",
            "0,1",
            "0 1",
            "-2",
            "1_1",
            "0000000000000002_0000000000000000",
            "0000000000000000_000000000000000a",
            "0000000000000000_00000000000000001",
        ],
    )
    def test_malformed_offsets_are_400(self, bad: str) -> None:
        with pytest.raises(ProtocolError) as err:
            offsets.decode(bad)
        assert err.value.status == 400

    def test_sentinels(self) -> None:
        assert offsets.parse_read_offset([]) == offsets.BEGINNING
        assert offsets.parse_read_offset(["-1"]) == offsets.BEGINNING
        assert offsets.parse_read_offset(["now"]) is None
        with pytest.raises(ProtocolError):
            offsets.parse_read_offset(["-1", "now"])


class TestCursor:
    def test_behind_or_absent_client_gets_current_interval(self) -> None:
        now = cursor.EPOCH_SECONDS + 20 * 1000 + 5
        assert cursor.response_cursor(None, now) == "1000"
        assert cursor.response_cursor(999, now) == "1000"

    def test_client_at_or_ahead_gets_strictly_greater(self) -> None:
        now = cursor.EPOCH_SECONDS + 20 * 1000
        rng = random.Random(1)
        for client in (1000, 1005, 99999):
            assert int(cursor.response_cursor(client, now, rng)) > client

    def test_malformed_client_cursor_is_400(self) -> None:
        assert cursor.parse_client_cursor([]) is None
        assert cursor.parse_client_cursor(["42"]) == 42
        for bad in (["x"], ["-1"], ["1.5"], ["1" * 19], ["1", "2"]):
            with pytest.raises(ProtocolError):
                cursor.parse_client_cursor(bad)


class TestHeaders:
    def test_stream_closed_only_true(self) -> None:
        assert is_true("true") and is_true("TRUE") and is_true("True")
        assert not any(is_true(v) for v in (None, "", "false", "yes", "1"))

    @pytest.mark.parametrize("bad", ["+3600", "03600", "3600.0", "3.6e3", "-1", "", " "])
    def test_ttl_strict_syntax(self, bad: str) -> None:
        with pytest.raises(ProtocolError):
            parse_expiry({"Stream-TTL": bad})

    def test_ttl_and_expires_together_rejected(self) -> None:
        with pytest.raises(ProtocolError):
            parse_expiry({"Stream-TTL": "10", "Stream-Expires-At": "2030-01-01T00:00:00Z"})

    def test_expires_at(self) -> None:
        assert parse_expires_at("1970-01-01T00:00:01Z") == 1000
        assert parse_expires_at("1970-01-01T01:00:01.5+01:00") == 1500
        for bad in ("tomorrow", "2030-01-01", "2030-01-01T00:00:00", "2030-13-01T00:00:00Z"):
            with pytest.raises(ProtocolError):
                parse_expires_at(bad)

    def test_producer_headers_all_or_none(self) -> None:
        assert parse_producer({}) is None
        p = parse_producer({"Producer-Id": "a", "Producer-Epoch": "1", "Producer-Seq": "2"})
        assert p is not None and (p.id, p.epoch, p.seq) == ("a", 1, 2)
        for partial in (
            {"Producer-Id": "a"},
            {"Producer-Id": "a", "Producer-Epoch": "0"},
            {"Producer-Id": "", "Producer-Epoch": "0", "Producer-Seq": "0"},
            {"Producer-Id": "a", "Producer-Epoch": "-1", "Producer-Seq": "0"},
            {"Producer-Id": "a", "Producer-Epoch": str(2**53), "Producer-Seq": "0"},
        ):
            with pytest.raises(ProtocolError):
                parse_producer(partial)

    def test_decimal(self) -> None:
        assert parse_decimal("0", "x") == 0
        with pytest.raises(ProtocolError):
            parse_decimal("05", "x")

    def test_content_types(self) -> None:
        assert validate_content_type("Application/JSON; charset=utf-8") == "application/json"
        with pytest.raises(ProtocolError):
            validate_content_type("not a type")
        assert is_text("text/plain") and is_text("application/json")
        assert not is_text("application/octet-stream")


class TestJsonMode:
    def test_flattens_one_level(self) -> None:
        assert list(split_messages(b'{"a": 1}', allow_empty_array=False)) == [b'{"a":1}']
        assert list(split_messages(b"[[1,2],[3,4]]", allow_empty_array=False)) == [b"[1,2]", b"[3,4]"]
        assert list(split_messages(b"[[[1,2,3]]]", allow_empty_array=False)) == [b"[[1,2,3]]"]

    def test_empty_array_only_on_create(self) -> None:
        assert body_entries("application/json", b"[]", create=True) == []
        with pytest.raises(ProtocolError):
            body_entries("application/json", b"[]", create=False)

    def test_invalid_json_rejected(self) -> None:
        for bad in (b"{", b"NaN", b"[1,]", b"\xff"):
            with pytest.raises(ProtocolError):
                list(split_messages(bad, allow_empty_array=False))

    def test_big_integers_survive(self) -> None:
        assert list(split_messages(b"[123456789012345678901234567890]", allow_empty_array=False)) == [
            b"123456789012345678901234567890"
        ]

    def test_state_protocol_events_get_their_offset(self) -> None:
        change = b'{"type":"user","key":"1","value":{"n":1},"headers":{"operation":"insert"}}'
        control = b'{"headers":{"control":"snapshot-end","offset":"stale"}}'
        end = offsets.encode(10 + len(change))
        assert orjson.loads(with_offset(10, change))["headers"] == {"operation": "insert", "offset": end}
        assert orjson.loads(with_offset(0, control))["headers"] == {
            "control": "snapshot-end",
            "offset": offsets.encode(len(control)),
        }
        # key order kept, the offset last in headers, as the reference server writes it
        assert with_offset(10, change) == change[:-2] + b',"offset":"' + end.encode() + b'"}}'
        for other in (
            b'{"headers":{"operation":1}}',
            b'{"headers":"x","type":"t"}',
            b'[{"headers":{"operation":"insert"}}]',
            b'"headers"',
            b'{"a":1}',
        ):
            assert with_offset(3, other) is other
        assert json_body([(0, b"1"), (1, change)]).startswith(b'[1,{"type":"user"')
        huge = b'{"headers":{"operation":"insert"},"n":123456789012345678901234567890}'
        assert with_offset(0, huge).endswith(b',"n":123456789012345678901234567890}')  # exact

    def test_array_response(self) -> None:
        assert to_array([]) == b"[]"
        assert to_array([b"1", b'{"a":2}']) == b'[1,{"a":2}]'


class TestEntries:
    def test_byte_bodies_are_cut_into_bounded_entries(self) -> None:
        body = bytes(range(256)) * 10
        packed = entries.pack_bytes(body, limit=1000)
        assert [size for size, _ in packed] == [1000, 1000, 560]
        assert b"".join(data for _, data in packed) == body
        assert entries.pack_bytes(b"") == []

    def test_json_messages_grouped_within_bounds(self) -> None:
        messages = [b"%d" % i for i in range(5000)]
        packed = entries.pack_messages(messages, max_bytes=1000, max_messages=300)
        assert all(len(data) <= 1000 and data.count(b"\n") < 300 for _, data in packed)
        assert entries.positions(packed) == sum(map(len, messages))
        split, pos = [], 0
        for size, data in packed:
            got = entries.messages(pos, data)
            assert got[-1][0] + len(got[-1][1]) == pos + size
            split += got
            pos += size
        assert [m for _, m in split] == messages
        assert [p for p, _ in split] == [sum(map(len, messages[:i])) for i in range(len(messages))]

    def test_a_large_message_goes_alone(self) -> None:
        big = b'"' + b"x" * 5000 + b'"'
        packed = entries.pack_messages([b"1", big, b"2"], max_bytes=1000)
        assert [data for _, data in packed] == [b"1", big, b"2"]

    def test_any_message_count_packs_into_few_entries(self) -> None:
        body = b"[" + b",".join([b"1"] * 200_000) + b"]"
        packed = body_entries("application/json", body, create=False)
        assert len(packed) == 200_000 // entries.JSON_ENTRY_MESSAGES + 1
        assert entries.positions(packed) == 200_000 and entries.stored_bytes(packed) == 400_000 - len(packed)

    def test_flatten_for_scripts(self) -> None:
        assert entries.flatten([(3, b"a\nbc"), (1, b"d")]) == [3, b"a\nbc", 1, b"d"]


class TestSse:
    def test_line_breaks_cannot_inject_events(self) -> None:
        frame = sse.data_event(b"a\r\nevent: control\rb\nc", text=True).decode()
        assert frame == "event: data\ndata:a\ndata:event: control\ndata:b\ndata:c\n\n"

    def test_leading_space_survives_parsers(self) -> None:
        assert sse.data_event(b" x", text=True) == b"event: data\ndata:  x\n\n"

    def test_binary_is_base64(self) -> None:
        frame = sse.data_event(b"\x00\x01\xff", text=False).decode()
        assert base64.b64decode(frame.split("data:")[1].strip()) == b"\x00\x01\xff"

    def test_control_event_omits_cursor_when_closed(self) -> None:
        closed = sse.control_event("o", cursor="7", up_to_date=True, closed=True)
        assert b"streamCursor" not in closed and b'"streamClosed":true' in closed
        open_ = sse.control_event("o", cursor="7", up_to_date=False, closed=False)
        assert b'"streamCursor":"7"' in open_ and b"upToDate" not in open_


class TestCaching:
    def test_etag_changes_with_closure_and_incarnation(self) -> None:
        a = caching.etag("s", "1", 0, 5, False)
        assert a != caching.etag("s", "1", 0, 5, True)
        assert a != caching.etag("s", "2", 0, 5, False)
        assert caching.matches(f'W/{a}, "other"', a)
        assert caching.matches("*", a)
        assert not caching.matches('"nope"', a)
        assert not caching.matches(None, a)


class TestKeys:
    def test_paths_with_braces_keep_one_hash_tag(self) -> None:
        path = "a/{b}/%7B/c"
        sid = keys.stream_id(path)
        assert "{" not in sid and "}" not in sid
        assert keys.path_of(sid) == path
        names = keys.stream_keys(sid)
        assert len({n.split("{", 1)[1].split("}", 1)[0] for n in names}) == 1
        assert keys.channel_stream_id(keys.notify_channel(sid)) == sid
        assert keys.split_segments_key(keys.segments(sid, "abc123")) == (sid, "abc123")

    def test_stream_paths_refuse_control_characters_only(self) -> None:
        from gateway.http.handlers import stream_name

        for good in ("a", "tenant/doc-1/é/日本", "x" * 100, "a b", "~!@$&*()"):
            assert stream_name(good, 1024) == good
        for bad in ("a\x00b", "a\nb", "tab\t", "del\x7f", "\x1f"):
            with pytest.raises(ProtocolError) as info:
                stream_name(bad, 1024)
            assert info.value.status == 400, repr(bad)
        with pytest.raises(ProtocolError):
            stream_name("é" * 600, 1024)  # 1,200 bytes of UTF-8


class TestSegments:
    ENTRIES = [(0, b"abc"), (3, b"defg"), (7, b"h"), (8, b"ijklmn")]

    def test_member_round_trip_and_file_names(self) -> None:
        name = file_name("chat/{1}", "inc1", 0, 14, 1_763_700_000_000)
        segment = Segment(0, 14, 1_763_700_000_000, 1_763_700_000_500, name)
        assert Segment.parse(segment.member.encode()) == segment and segment.size == 14
        assert name.startswith(f"date=2025-11-21/bucket={bucket_of('chat/{1}'):02d}/")
        assert name.endswith("-inc1-0000000000000000-0000000000000014.parquet")
        assert file_name("chat/{1}", "inc1", 0, 14, 1_763_700_000_000) == name  # retries overwrite
        assert 0 <= bucket_of("x") < 16 and bucket_of("x") == bucket_of("x")

    def test_take_cuts_bytes_like_the_log_does(self) -> None:
        assert take(self.ENTRIES, 0, None, 100, False, 100) == self.ENTRIES
        assert take(self.ENTRIES, 5, None, 100, False, 100) == [(5, b"fg"), (7, b"h"), (8, b"ijklmn")]
        assert take(self.ENTRIES, 1, None, 4, False, 100) == [(1, b"bc"), (3, b"de")]
        assert take(self.ENTRIES, 0, 9, 100, False, 100) == [(0, b"abc"), (3, b"defg"), (7, b"h"), (8, b"i")]
        assert take(self.ENTRIES, 0, None, 100, False, 2) == [(0, b"abc"), (3, b"defg")]
        assert take(self.ENTRIES, 14, None, 100, False, 100) == []

    def test_take_never_cuts_json_messages(self) -> None:
        assert take(self.ENTRIES, 3, None, 2, True, 100) == [(3, b"defg")]  # overruns the budget
        assert take(self.ENTRIES, 4, None, 100, True, 100) == [(7, b"h"), (8, b"ijklmn")]
        assert take(self.ENTRIES, 0, None, 0, True, 100) == []


def test_durability_assessment() -> None:
    assert durability.assess("yes", "always") is None
    assert "everysec" in (durability.assess("yes", "everysec") or "")
    assert "appendonly is off" in (durability.assess("no", "always") or "")


class TestNotices:
    def test_parse_with_and_without_payload(self) -> None:
        n = notices.parse(b"5 12 0 3,4\nabcdefg")
        assert n == notices.Notice(5, 12, False, ((5, b"abc"), (8, b"defg")))
        assert notices.parse(b"5 99 0") == notices.Notice(5, 99, False, None)
        assert notices.parse(b"7 7 1") == notices.Notice(7, 7, True, ())
        for bad in (b"deleted", b"5 12 0 3,4\nabc", b"x y z", b""):
            assert notices.parse(bad) is None

    def test_the_time_of_publication_rides_along(self) -> None:
        n = notices.parse(b"5 12 0 t1764230000123 3,4\nabcdefg")
        assert n == notices.Notice(5, 12, False, ((5, b"abc"), (8, b"defg")), 1764230000123)
        assert notices.parse(b"5 99 0 t17") == notices.Notice(5, 99, False, None, 17)
        assert notices.parse(b"7 7 1 t17") == notices.Notice(7, 7, True, (), 17)
        assert notices.parse(b"5 12 0 3,4\nabcdefg").sent_ms is None  # a build before the field
        assert notices.parse(b"5 12 0 tx 3,4\nabcdefg") is None

    def test_json_groups_are_split_into_messages(self) -> None:
        # a JSON entry of three messages (7 stored bytes, 5 positions) beside a plain one
        n = notices.parse(b"10 17 0 7:5,2\n1\n22\n33[]")
        assert n == notices.Notice(10, 17, False, ((10, b"1"), (11, b"22"), (13, b"33"), (15, b"[]")))
        assert notices.parse(b"10 16 0 7:4\n1\n22\n33") is None  # positions that do not add up

    def test_stitch_needs_an_unbroken_run_with_data(self) -> None:
        a = notices.Notice(0, 2, False, ((0, b"ab"),))
        b = notices.Notice(2, 3, False, ((2, b"c"),))
        close = notices.Notice(3, 3, True, ())
        d = notices.stitch([a, b, close], 0)
        assert d is not None and d.entries == ((0, b"ab"), (2, b"c")) and d.tail == 3 and d.closed
        assert notices.stitch([a, b], 2).entries == ((2, b"c"),)
        assert notices.stitch([b], 0) is None  # missed the notice for 0..2
        assert notices.stitch([a, notices.Notice(2, 50, False, None)], 0) is None  # too big to carry
        assert notices.stitch([a], 1) is None  # reader inside a notice
        assert notices.stitch([], 0) is None

    def test_recent_forgets_on_unknown_messages(self) -> None:
        recent = notices.Recent()
        recent.add(notices.Notice(0, 1, False, ((0, b"x"),)))
        assert recent.delivery(0) is recent.delivery(0)  # shared between readers
        recent.add(None)
        assert recent.delivery(0) is None
