"""Decoding messages with the definitions that travel in META records: types no standard
type store knows, in every definition format bags store (ROS 1 msg, ROS 2 msg, sectioned
ROS 2 IDL as rosbag2 and MCAP write it)."""

from __future__ import annotations

import pytest
from rosbags.typesys import Stores, get_types_from_idl, get_types_from_msg, get_typestore

from adcloud.binpipe import BinpipeError, ConnectionInfo, Message, MessageDecoder
from adcloud.binpipe.codec import BlockKind, encode_block
from adcloud.binpipe.decode import decoded_messages, types_from_idl

SEP = "=" * 80 + "\n"

# A type of a package no standard store has, using a second such type.
IDL_SECTIONS = (
    f"{SEP}IDL: survey_msgs/msg/Landmark\n"
    "module survey_msgs { module msg {\n"
    "  struct Landmark { survey_msgs::msg::Position where; string label; uint16 votes; };\n"
    "}; };\n"
    f"{SEP}IDL: survey_msgs/msg/Position\n"
    "module survey_msgs { module msg {\n"
    "  struct Position { double x; double y; };\n"
    "}; };\n"
)
ROS1_MSG = "Position where\nstring label\nuint16 votes\n" + SEP + "MSG: survey_msgs/Position\n"
ROS1_MSG += "float64 x\nfloat64 y\n"


def _serialized(types: dict[str, object], cdr: bool) -> bytes:
    store = get_typestore(Stores.EMPTY)
    store.register(types)  # type: ignore[arg-type]
    position = store.types["survey_msgs/msg/Position"](x=1.5, y=-2.25)
    landmark = store.types["survey_msgs/msg/Landmark"](where=position, label="stop", votes=7)
    if cdr:
        return bytes(store.serialize_cdr(landmark, "survey_msgs/msg/Landmark"))
    return bytes(store.serialize_ros1(landmark, "survey_msgs/msg/Landmark"))


def test_sectioned_idl_gives_every_type() -> None:
    types = types_from_idl(IDL_SECTIONS)
    assert set(types) == {"survey_msgs/msg/Landmark", "survey_msgs/msg/Position"}
    with pytest.raises(Exception, match=r"."):  # rosbags alone cannot parse the sections
        get_types_from_idl(IDL_SECTIONS)


@pytest.mark.parametrize("fmt", ["ros2idl", "ros1msg"])
def test_custom_types_decode_from_their_travelling_definition(fmt: str) -> None:
    if fmt == "ros2idl":
        data = _serialized(types_from_idl(IDL_SECTIONS), cdr=True)
        conn = ConnectionInfo(
            "/landmarks", "survey_msgs/msg/Landmark", fmt, IDL_SECTIONS, "", "cdr"
        )
    else:
        data = _serialized(
            dict(get_types_from_msg(ROS1_MSG, "survey_msgs/msg/Landmark")), cdr=False
        )
        conn = ConnectionInfo("/landmarks", "survey_msgs/msg/Landmark", fmt, ROS1_MSG, "", "ros1")
    decoder = MessageDecoder([conn])
    msg = decoder.decode(Message("/landmarks", 5, "survey_msgs/msg/Landmark", data))
    assert (msg.where.x, msg.where.y, msg.label, msg.votes) == (1.5, -2.25, "stop", 7)


def test_a_type_without_definition_is_named() -> None:
    data = _serialized(types_from_idl(IDL_SECTIONS), cdr=True)
    with pytest.raises(
        BinpipeError, match=r"no definition for message type survey_msgs/msg/Landmark"
    ):
        MessageDecoder().decode(Message("/landmarks", 5, "survey_msgs/msg/Landmark", data))


def test_a_broken_definition_names_type_and_topic() -> None:
    conn = ConnectionInfo(
        "/landmarks", "survey_msgs/msg/Landmark", "ros2idl", f"{SEP}IDL: x\nmodule {{", "", "cdr"
    )
    with pytest.raises(BinpipeError, match=r"survey_msgs/msg/Landmark \(topic /landmarks\)"):
        MessageDecoder([conn]).decode(Message("/landmarks", 5, "survey_msgs/msg/Landmark", b""))


def test_a_message_whose_definition_never_arrived_says_so() -> None:
    """ROS 1 bytes of a standard type with no META block (a pipe command that dropped it):
    CDR is assumed, and the error says why instead of only 'missing string terminator'."""
    store = get_typestore(Stores.ROS1_NOETIC)
    msg = store.types["std_msgs/msg/String"](data="hello")
    data = bytes(store.serialize_ros1(msg, "std_msgs/msg/String"))[:-2]
    with pytest.raises(BinpipeError, match=r"no message definition \(META block\)"):
        MessageDecoder().decode(Message("/chatter", 5, "std_msgs/msg/String", data))
    conn = ConnectionInfo("/chatter", "std_msgs/msg/String", "", "", "", "ros1")
    with pytest.raises(BinpipeError) as info:  # said to be ROS 1 and still broken: no hint
        MessageDecoder([conn]).decode(Message("/chatter", 5, "std_msgs/msg/String", data))
    assert "META" not in str(info.value)


def test_ros1_and_ros2_definitions_of_one_name_decode_side_by_side() -> None:
    """A ROS 2 bag's messages and a node's ROS 1 outputs in one decoder (a replay judged
    against its bag): the two layouts of ``survey_msgs/msg/Position`` -- as a ROS 2
    ``std_msgs/Header`` lacks the ROS 1 ``seq`` -- were "conflicting definitions" in the
    one type store all definitions shared."""
    ros1_def = ROS1_MSG.replace("float64 y\n", "float64 y\nfloat64 z\n")
    ros1_types = dict(get_types_from_msg(ros1_def, "survey_msgs/msg/Landmark"))
    ros1_store = get_typestore(Stores.EMPTY)
    ros1_store.register(ros1_types)  # type: ignore[arg-type]
    where = ros1_store.types["survey_msgs/msg/Position"](x=3.0, y=4.0, z=5.0)
    landmark = ros1_store.types["survey_msgs/msg/Landmark"](where=where, label="yield", votes=2)
    ros1_data = bytes(ros1_store.serialize_ros1(landmark, "survey_msgs/msg/Landmark"))
    decoder = MessageDecoder(
        [
            ConnectionInfo(
                "/landmarks", "survey_msgs/msg/Landmark", "ros2idl", IDL_SECTIONS, "", "cdr"
            ),
            ConnectionInfo("/found", "survey_msgs/msg/Landmark", "ros1msg", ros1_def, "", "ros1"),
        ]
    )
    cdr_data = _serialized(types_from_idl(IDL_SECTIONS), cdr=True)
    for _ in range(2):  # and again, once both are registered
        bag = decoder.decode(Message("/landmarks", 5, "survey_msgs/msg/Landmark", cdr_data))
        out = decoder.decode(Message("/found", 6, "survey_msgs/msg/Landmark", ros1_data))
        assert (bag.where.x, bag.where.y, bag.label) == (1.5, -2.25, "stop")
        assert (out.where.x, out.where.y, out.where.z, out.label) == (3.0, 4.0, 5.0, "yield")


@pytest.mark.parametrize(
    ("record", "shown"),
    [
        (("/t", "std_msgs/msg/String", "ros1msg"), "(str, str, str)"),
        (("/t", "std_msgs/msg/String", "ros1msg", "string data", None, "ros1"), "NoneType"),
    ],
)
def test_a_meta_record_that_is_no_definition_is_named(
    record: tuple[object, ...], shown: str
) -> None:
    """A node that wrote a META record of another shape: decoded_messages failed with
    ConnectionInfo's own TypeError ("missing 3 required positional arguments")."""
    data = encode_block([("/t", 5, "std_msgs/msg/String", b"\x02\0\0\0hi")])
    meta = encode_block([record], kind=BlockKind.META)
    with pytest.raises(BinpipeError, match=r"META block at index 1 of the partition") as info:
        list(decoded_messages([encode_block([]), meta, data]))
    assert shown in str(info.value) and "expected 6 str" in str(info.value)
    good = ConnectionInfo("/t", "std_msgs/msg/String", "", "", "", "ros1")
    assert ConnectionInfo.from_record(tuple(good)) == good
