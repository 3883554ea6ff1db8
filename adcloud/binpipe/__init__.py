"""BinPipe: ROS bags as binary byte-stream partitions for Spark."""

from __future__ import annotations
