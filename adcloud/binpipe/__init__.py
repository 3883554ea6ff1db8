"""BinPipe: ROS bags as binary byte-stream partitions for Spark.

- :mod:`~adcloud.binpipe.codec` -- the stream format (records, blocks, streams);
- :mod:`~adcloud.binpipe.bags` -- reading ROS 1, ROS 2 and MCAP bags by byte range;
- :class:`BinPipeRDD` -- an RDD of blocks with ``pipe``, ``map_records``, ``save``;
- :mod:`~adcloud.binpipe.datasource` -- ``spark.read.format("rosbag")``;
- :mod:`~adcloud.binpipe.node` -- the Python side of a pipe command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adcloud._lazy import lazy_exports

if TYPE_CHECKING:
    from adcloud.binpipe.arrays import image_array, pointcloud_array
    from adcloud.binpipe.bags import (
        BagFormat,
        BagPartition,
        BagSummary,
        Connection,
        TimeSource,
        plan_partitions,
        read_partition,
        read_partition_timed,
        summarize,
    )
    from adcloud.binpipe.codec import (
        Block,
        BlockKind,
        FieldType,
        Message,
        Record,
        StreamReader,
        StreamWriter,
        encode_stream,
        iter_blocks,
        iter_records,
    )
    from adcloud.binpipe.decode import (
        ConnectionInfo,
        MessageDecoder,
        decoded_messages,
        read_messages,
    )
    from adcloud.binpipe.errors import BagError, BinpipeError, PipeCommandError
    from adcloud.binpipe.rdd import BinPipeRDD, expand_uris
    from adcloud.binpipe.reindex import reindex_bag

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "arrays": ("image_array", "pointcloud_array"),
        "bags": (
            "BagFormat",
            "BagPartition",
            "BagSummary",
            "Connection",
            "TimeSource",
            "plan_partitions",
            "read_partition",
            "read_partition_timed",
            "summarize",
        ),
        "codec": (
            "Block",
            "BlockKind",
            "FieldType",
            "Message",
            "Record",
            "StreamReader",
            "StreamWriter",
            "encode_stream",
            "iter_blocks",
            "iter_records",
        ),
        "decode": ("ConnectionInfo", "MessageDecoder", "decoded_messages", "read_messages"),
        "errors": ("BagError", "BinpipeError", "PipeCommandError"),
        "rdd": ("BinPipeRDD", "expand_uris"),
        "reindex": ("reindex_bag",),
    },
)

__all__ = [
    "BagError",
    "BagFormat",
    "BagPartition",
    "BagSummary",
    "BinPipeRDD",
    "BinpipeError",
    "Block",
    "BlockKind",
    "Connection",
    "ConnectionInfo",
    "FieldType",
    "Message",
    "MessageDecoder",
    "PipeCommandError",
    "Record",
    "StreamReader",
    "StreamWriter",
    "TimeSource",
    "decoded_messages",
    "encode_stream",
    "expand_uris",
    "image_array",
    "iter_blocks",
    "iter_records",
    "plan_partitions",
    "pointcloud_array",
    "read_messages",
    "read_partition",
    "read_partition_timed",
    "reindex_bag",
    "summarize",
]
