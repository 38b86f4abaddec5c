"""Typed, versioned msgpack messages; one module per channel, `codec` for framing, `sampling` and
`structured` for the request parameters they carry."""
from orca_mq.protocol import client_msgs, control_msgs, engine_msgs
from orca_mq.protocol.codec import PROTOCOL_VERSION, ProtocolError, decode, encode, unpack

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "client_msgs", "control_msgs", "decode", "encode", "engine_msgs", "unpack"]
