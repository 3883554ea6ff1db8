"""Decoding messages with the definitions that travel in META records: types no standard
type store knows, in every definition format bags store (ROS 1 msg, ROS 2 msg, sectioned
ROS 2 IDL as rosbag2 and MCAP write it)."""

from __future__ import annotations

import pytest
from rosbags.typesys import Stores, get_types_from_idl, get_types_from_msg, get_typestore

from adcloud.binpipe import BinpipeError, ConnectionInfo, Message, MessageDecoder
from adcloud.binpipe.codec import BlockKind, encode_block
from adcloud.binpipe.decode import decoded_messages, meta_block, types_from_idl

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


# Two versions of one custom type, as two bags recorded before and after a change to it.
POSITION_V1 = "float64 x\nfloat64 y\n"
POSITION_V2 = "float64 x\nfloat64 y\nstring label\n"
POSITION = "survey_msgs/msg/Position"


def _position(definition: str, fmt: str, **fields: float | str) -> bytes:
    store = get_typestore(Stores.EMPTY)
    store.register(get_types_from_msg(definition, POSITION))
    msg = store.types[POSITION](**fields)
    if fmt == "ros1":
        return bytes(store.serialize_ros1(msg, POSITION))
    return bytes(store.serialize_cdr(msg, POSITION))


@pytest.mark.parametrize(("fmt", "serialization"), [("ros1msg", "ros1"), ("ros2msg", "cdr")])
def test_a_later_meta_record_replaces_the_definition_for_the_data_after_it(
    fmt: str, serialization: str
) -> None:
    """Two bags piped through one node, the custom type changed in between: the second
    bag's messages were decoded with the first bag's definition (a size mismatch, or
    garbage), as the decoder kept the first definition of a type.  Back and forth, each
    version decodes with its own; a definition seen before is not registered again."""
    v1 = meta_block([ConnectionInfo("/pos", POSITION, fmt, POSITION_V1, "", serialization)])
    v2 = meta_block([ConnectionInfo("/pos", POSITION, fmt, POSITION_V2, "", serialization)])
    first = _position(POSITION_V1, serialization, x=1.0, y=2.0)
    second = _position(POSITION_V2, serialization, x=3.0, y=4.0, label="moved")
    blocks = [
        *(v1, encode_block([("/pos", 1, POSITION, first)])),
        *(v2, encode_block([("/pos", 2, POSITION, second)])),
        *(v1, encode_block([("/pos", 3, POSITION, first)])),
        *(v2, encode_block([("/pos", 4, POSITION, second)])),
    ]
    got = [(m.timestamp, d) for m, d in decoded_messages(blocks)]
    assert [(t, d.x, d.y, getattr(d, "label", None)) for t, d in got] == [
        (1, 1.0, 2.0, None),
        (2, 3.0, 4.0, "moved"),
        (3, 1.0, 2.0, None),
        (4, 3.0, 4.0, "moved"),
    ]
    assert type(got[0][1]) is type(got[2][1]) and type(got[1][1]) is type(got[3][1])


def test_a_later_meta_record_replaces_the_serialization_of_its_topic() -> None:
    """The same topic carries ROS 1 messages and, after a META record that says so, CDR
    messages of another type (a node's outputs after a bag's on one topic): the CDR bytes
    were decoded as ROS 1, as the topic's first serialization was kept."""
    ros1 = get_typestore(Stores.ROS1_NOETIC)
    ros2 = get_typestore(Stores.ROS2_HUMBLE)
    text = bytes(
        ros1.serialize_ros1(ros1.types["std_msgs/msg/String"](data="hi"), "std_msgs/msg/String")
    )
    number = ros2.types["std_msgs/msg/Int32"](data=-7)
    cdr = bytes(ros2.serialize_cdr(number, "std_msgs/msg/Int32"))
    blocks = [
        meta_block([ConnectionInfo("/out", "std_msgs/msg/String", "", "", "", "ros1")]),
        encode_block([("/out", 1, "std_msgs/msg/String", text)]),
        meta_block([ConnectionInfo("/out", "std_msgs/msg/Int32", "", "", "", "cdr")]),
        encode_block([("/out", 2, "std_msgs/msg/Int32", cdr)]),
    ]
    assert [d.data for _, d in decoded_messages(blocks)] == ["hi", -7]


def test_a_changed_dependency_leaves_the_types_decoded_before_it_working() -> None:
    """``Position`` redefined on its own topic after ``Landmark``, which uses the first
    ``Position``, was decoded: rosbags refuses to redefine a type in one store, so the
    new definition goes in a fresh store and ``Landmark`` keeps decoding with its own."""
    landmark_def = "Position where\nstring label\nuint16 votes\n" + SEP
    landmark_def += "MSG: survey_msgs/Position\n" + POSITION_V1
    landmark = ConnectionInfo(
        "/landmarks", "survey_msgs/msg/Landmark", "ros1msg", landmark_def, "", "ros1"
    )
    landmark_data = _serialized(
        dict(get_types_from_msg(landmark_def, "survey_msgs/msg/Landmark")), cdr=False
    )
    decoder = MessageDecoder([landmark])
    before = decoder.decode(Message("/landmarks", 1, "survey_msgs/msg/Landmark", landmark_data))
    decoder.add(ConnectionInfo("/pos", POSITION, "ros1msg", POSITION_V2, "", "ros1"))
    second = _position(POSITION_V2, "ros1", x=3.0, y=4.0, label="moved")
    pos = decoder.decode(Message("/pos", 2, POSITION, second))
    after = decoder.decode(Message("/landmarks", 3, "survey_msgs/msg/Landmark", landmark_data))
    assert (pos.x, pos.y, pos.label) == (3.0, 4.0, "moved")
    for got in (before, after):
        assert (got.where.x, got.where.y, got.label, got.votes) == (1.5, -2.25, "stop", 7)


def test_a_record_without_definition_keeps_the_known_one() -> None:
    """The replay judge's decoder: the bag's connections, then an output guessed to be of
    the bag's serialization with no definition.  The custom type keeps its definition
    (there is no standard one to fall back on), on both topics."""
    data = _serialized(dict(get_types_from_msg(ROS1_MSG, "survey_msgs/msg/Landmark")), cdr=False)
    bag = ConnectionInfo("/landmarks", "survey_msgs/msg/Landmark", "ros1msg", ROS1_MSG, "", "ros1")
    guessed = ConnectionInfo("/echo", "survey_msgs/msg/Landmark", "", "", "", "ros1")
    decoder = MessageDecoder([bag, guessed])
    for topic in ("/landmarks", "/echo"):
        got = decoder.decode(Message(topic, 5, "survey_msgs/msg/Landmark", data))
        assert (got.where.x, got.label, got.votes) == (1.5, "stop", 7)
    decoder.add(guessed)  # after the definition was registered, too
    got = decoder.decode(Message("/echo", 6, "survey_msgs/msg/Landmark", data))
    assert (got.where.y, got.label) == (-2.25, "stop")


def test_a_definition_for_a_type_decoded_from_the_standard_store_is_used() -> None:
    """A topic decoded with rosbags' standard ``std_msgs/String`` before any META block,
    then a META record with a (different) definition of that name: the messages after it
    decode with the definition the record carries."""
    ros1 = get_typestore(Stores.ROS1_NOETIC)
    text = bytes(
        ros1.serialize_ros1(ros1.types["std_msgs/msg/String"](data="hi"), "std_msgs/msg/String")
    )
    decoder = MessageDecoder([ConnectionInfo("/s", "std_msgs/msg/String", "", "", "", "ros1")])
    assert decoder.decode(Message("/s", 1, "std_msgs/msg/String", text)).data == "hi"
    custom = "string data\nuint8 level\n"
    decoder.add(ConnectionInfo("/s", "std_msgs/msg/String", "ros1msg", custom, "", "ros1"))
    own = get_typestore(Stores.EMPTY)
    own.register(get_types_from_msg(custom, "std_msgs/msg/String"))
    leveled = own.types["std_msgs/msg/String"](data="ho", level=3)
    raw = bytes(own.serialize_ros1(leveled, "std_msgs/msg/String"))
    got = decoder.decode(Message("/s", 2, "std_msgs/msg/String", raw))
    assert (got.data, got.level) == ("ho", 3)


def test_a_data_record_that_is_no_message_names_its_block() -> None:
    """Blocks of other records (``BinPipeRDD.from_records``) given to decoded_messages: the
    error said only "expected message records, got a 2-field record"."""
    data = encode_block([("/t", 1.5)])
    with pytest.raises(BinpipeError, match=r"DATA block at index 1 of the partition") as info:
        list(decoded_messages([meta_block([]), data]))
    assert "(str, float)" in str(info.value) and "section 9.1" in str(info.value)
