"""An append's script arguments: the direct encoding (AppendRequest.encoded_args) is byte
for byte the generic one (encoded(script_args())), and refuses what it refuses."""

from __future__ import annotations

import pytest

from gateway.protocol.errors import ProtocolError
from gateway.protocol.headers import Producer
from gateway.streams.appends import AppendRequest, encoded

REQUESTS = [
    AppendRequest("text/plain", False, "", None, [(100, b"x" * 100)]),
    AppendRequest("", True, "", None, []),
    AppendRequest("application/json", False, "seq-7", Producer("p-1", 3, 12), [(2, b"[1]"), (1, b"{}")]),
    AppendRequest("text/plain", True, "", None, [(3, memoryview(b"abc"))], if_match="e", expected_offset="9"),
    AppendRequest("text/plain", False, "", None, [(5, b"hello")], token="t" * 32, total=9000),
    AppendRequest("text/plain; charset=ünï", False, "", Producer("ü", 0, 0), [(1, b"z")]),
]


@pytest.mark.parametrize("request_", REQUESTS)
def test_direct_encoding_is_the_generic_one(request_: AppendRequest) -> None:
    direct = request_.encoded_args()
    generic = encoded(request_.script_args())
    assert [bytes(a) for a in direct] == [bytes(a) for a in generic]
    assert [type(a) for a in direct] == [type(a) for a in generic]


def test_an_unencodable_header_value_is_a_bad_request_either_way() -> None:
    bad = AppendRequest("text/plain", False, "\udc80", None, [(1, b"x")])
    for encode in (bad.encoded_args, lambda: encoded(bad.script_args())):
        with pytest.raises(ProtocolError) as raised:
            encode()
        assert raised.value.status == 400
