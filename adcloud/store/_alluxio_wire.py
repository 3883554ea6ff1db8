"""The Alluxio 2.x REST proxy wire format, shared by the server and the client backend.

Endpoints (all ``POST`` unless noted; ``{path}`` is the absolute Alluxio path, so URLs carry a
double slash, ``/api/v1/paths//a/b/create-file``, exactly as the ``alluxio`` 0.1.x client
sends them):

- ``/api/v1/paths/{path}/{action}`` with a JSON options body, action one of
  ``create-directory``, ``create-file`` (returns a stream id), ``delete``, ``exists``
  (returns a JSON boolean), ``free``, ``get-status`` (a ``FileInfo`` object),
  ``list-status`` (a list of them), ``open-file`` (a stream id), ``rename`` (query ``dst``),
  ``set-attribute``, ``mount``/``unmount``; ``GET .../download-file`` returns the bytes;
- ``/api/v1/streams/{id}/{write|read|close}``: ``write`` appends the octet-stream body and
  returns the byte count, ``read`` returns the rest of the file, ``close`` ends the stream.

Errors are HTTP 500 (as the real proxy's ``RestUtils``) or a transport-level 4xx/503, always
with a JSON body ``{"statusCode": "<Alluxio status>", "message": "..."}``.

Options use the 2.x (protobuf ``*POptions``) layout -- TTL in ``commonOptions`` -- and
the server also accepts the 1.x layout that ``alluxio`` 0.1.x sends (top-level ``ttl`` and
``ttlAction``).  adcloud extensions, ignored by other clients: ``FileInfo.adcloud``
(checksum, write type, tier), ``create-file`` option ``overwrite``,
``POST /api/v1/paths/{path}/persist`` and ``POST /api/v1/streams/{id}/cancel``.
"""

from __future__ import annotations

import json
from typing import Any

from adcloud._crc import crc32
from adcloud.store.base import FileStatus, PersistenceState, TtlAction, WriteType

__all__ = [
    "API_PREFIX",
    "DEFAULT_PORT",
    "error_body",
    "file_info",
    "status_from_info",
    "ttl_option",
]

API_PREFIX = "/api/v1"
DEFAULT_PORT = 39999
_TIER_PERCENT = {"MEM": 100}


def error_body(status: str, message: str) -> bytes:
    """The JSON body of an error response."""
    return json.dumps({"statusCode": status, "message": message}).encode()


def file_info(status: FileStatus, *, host: str, port: int) -> dict[str, Any]:
    """A ``FileInfo``/``URIStatus`` JSON object for ``status`` (one block per cached file)."""
    file_id = crc32(status.path.encode("utf-8"))
    mtime_ms = int(status.mtime * 1000)
    blocks: list[dict[str, Any]] = []
    if not status.is_dir and status.tier is not None:
        blocks.append(
            {
                "blockInfo": {
                    "blockId": file_id << 24,
                    "length": status.size,
                    "locations": [
                        {
                            "workerId": 1,
                            "workerAddress": {
                                "host": host,
                                "rpcPort": 0,
                                "dataPort": 0,
                                "webPort": port,
                            },
                            "tierAlias": status.tier,
                        }
                    ],
                },
                "offset": 0,
                "ufsLocations": [],
            }
        )
    in_mem = _TIER_PERCENT.get(status.tier or "", 0) if not status.is_dir else 0
    return {
        "blockIds": [b["blockInfo"]["blockId"] for b in blocks],
        "blockSizeBytes": max(status.size, 1),
        "cacheable": True,
        "completed": True,
        "creationTimeMs": mtime_ms,
        "lastModificationTimeMs": mtime_ms,
        "lastAccessTimeMs": mtime_ms,
        "fileBlockInfos": blocks,
        "fileId": file_id,
        "folder": status.is_dir,
        "owner": "",
        "group": "",
        "inMemoryPercentage": in_mem,
        "inAlluxioPercentage": 100 if blocks else 0,
        "length": status.size,
        "name": status.name,
        "path": status.path,
        "ufsPath": "",
        "pinned": status.pinned,
        "persisted": status.persisted,
        "persistenceState": str(status.persistence),
        "mode": 0o755 if status.is_dir else 0o644,
        "mountPoint": False,
        "ttl": -1 if status.ttl is None else round(status.ttl * 1000),
        "ttlAction": str(status.ttl_action),
        "adcloud": {
            "checksum": status.checksum,
            "writeType": None if status.write_type is None else str(status.write_type),
            "tier": status.tier,
        },
    }


def status_from_info(info: dict[str, Any]) -> FileStatus:
    """A :class:`FileStatus` from a ``FileInfo`` JSON object (real Alluxio or adcloud)."""
    extra = info.get("adcloud") or {}
    tier = extra.get("tier")
    if tier is None:
        for block in info.get("fileBlockInfos") or []:
            for location in (block.get("blockInfo") or {}).get("locations") or []:
                tier = location.get("tierAlias") or tier
                break
            if tier is not None:
                break
    ttl = info.get("ttl", -1)
    state = str(info.get("persistenceState") or "")
    persistence = (
        PersistenceState(state)
        if state in PersistenceState.__members__
        else (
            PersistenceState.PERSISTED if info.get("persisted") else PersistenceState.NOT_PERSISTED
        )
    )
    action = str(info.get("ttlAction") or "DELETE")
    write_type = str(extra.get("writeType"))
    return FileStatus(
        path=str(info.get("path") or "/"),
        size=int(info.get("length") or 0),
        is_dir=bool(info.get("folder")),
        mtime=float(info.get("lastModificationTimeMs") or 0) / 1000,
        tier=tier,
        pinned=bool(info.get("pinned")),
        persistence=persistence,
        ttl=None if ttl is None or int(ttl) < 0 else int(ttl) / 1000,
        ttl_action=TtlAction(action) if action in TtlAction.__members__ else TtlAction.DELETE,
        checksum=extra.get("checksum"),
        write_type=WriteType(write_type) if write_type in WriteType.__members__ else None,
    )


def ttl_option(options: dict[str, Any]) -> tuple[int | None, str | None]:
    """``(ttl in ms or None, action or None)`` from options in the 2.x or the 1.x layout."""
    common = options.get("commonOptions")
    ttl = options.get("ttl")
    action = options.get("ttlAction")
    if isinstance(common, dict):
        ttl = common.get("ttl", ttl)
        action = common.get("ttlAction", action)
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int)):
        raise ValueError(f"ttl must be an integer number of milliseconds, not {ttl!r}")
    if action is not None and not isinstance(action, str):
        raise ValueError(f"ttlAction must be a string, not {action!r}")
    return ttl, action
