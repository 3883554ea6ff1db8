"""Settings of the local tiered store and the store clients (settings section ``store``).

Every field can be overridden with ``ADCLOUD_STORE_<FIELD>``.  ``ADCLOUD_STORE_ROOT=/x``
moves every local directory -- tiers, metadata, locks and the default under-store -- below
``/x`` (``/x/mem``, ``/x/ssd``, ``/x/hdd``, ``/x/ufs``): sandboxes and tests use it so they
never touch the user's real store.  Directories named explicitly win over ``root``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from adcloud.config import load_settings
from adcloud.errors import ConfigError
from adcloud.store.base import WriteType, parse_size
from adcloud.store.errors import StoreError

__all__ = ["StoreSettings", "TierSpec"]

TIER_NAMES = ("MEM", "SSD", "HDD")


class TierSpec(NamedTuple):
    """One cache tier: its alias (``MEM``/``SSD``/``HDD``), directory and capacity in bytes."""

    name: str
    directory: Path
    capacity: int


def _default_mem_base() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"adcloud-{os.getuid()}"


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """Where the local tiers live, how big they are, and the store's defaults.

    Capacities are sizes like ``"4GiB"`` or ``"512MB"``; ``"0"`` disables a tier.
    ``ufs`` is the under-store (any fsspec URL) that persisted files go to.  ``write_type``
    is the default :class:`~adcloud.store.base.WriteType` (Alluxio 2.x's default,
    ``ASYNC_THROUGH``).  ``verify_reads`` says which reads are checked against the recorded
    CRC-32: ``"disk"`` (SSD, HDD and under-store copies: media and crashes corrupt those),
    ``"all"`` (MEM too; about 25 ms per 100 MB on the reference machine) or ``"none"``.  The
    size of every read is always checked, and tier moves and persists always verify.
    ``token`` is the bearer token that ``alluxio://`` clients send and ``adcloud store serve``
    requires.
    """

    root: Path | None = None
    mem_dir: Path | None = None
    ssd_dir: Path | None = None
    hdd_dir: Path | None = None
    meta_dir: Path | None = None
    mem_capacity: str = "4GiB"
    ssd_capacity: str = "50GiB"
    hdd_capacity: str = "200GiB"
    ufs: str | None = None
    write_type: str = "ASYNC_THROUGH"
    promote_on_read: bool = True
    verify_reads: str = "disk"
    ttl_check_interval: float = 1.0
    persist_retry_interval: float = 5.0
    token: str | None = None

    def __post_init__(self) -> None:
        for name in ("mem_capacity", "ssd_capacity", "hdd_capacity"):
            try:
                parse_size(getattr(self, name))
            except StoreError as err:
                raise ConfigError(f"store.{name}: {err}") from err
        if self.verify_reads not in ("all", "disk", "none"):
            raise ConfigError(
                f"store.verify_reads: {self.verify_reads!r} is not one of all, disk, none"
            )
        try:
            WriteType.parse(self.write_type)
        except StoreError as err:
            raise ConfigError(f"store.write_type: {err}") from err
        for name in ("root", "mem_dir", "ssd_dir", "hdd_dir", "meta_dir"):
            given = getattr(self, name)
            if given is not None and not Path(given).expanduser().is_absolute():
                # each process (a Spark executor runs in its own work directory) would open
                # its own store below its working directory instead of the shared one
                raise ConfigError(
                    f"store.{name}: {str(given)!r} is a relative path; give an absolute one"
                )
        if self.ufs:
            scheme, sep, rest = self.ufs.partition("://")
            local = rest if sep and scheme.lower() in ("file", "local") else None
            local = self.ufs if not sep else local
            if local is not None and not Path(local or "/").expanduser().is_absolute():
                # every process would persist below its own working directory, and a file
                # persisted by one would be missing for the others
                raise ConfigError(
                    f"store.ufs: {self.ufs!r} is a relative path; give an absolute one "
                    "(file:///DIR or /DIR) or a URL such as hdfs://... or s3://..."
                )

    @classmethod
    def load(
        cls,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> StoreSettings:
        """Defaults, then the ``store`` section of ``file``, ``ADCLOUD_STORE_*``, ``overrides``."""
        return load_settings(cls, "store", file=file, environ=environ, **overrides)

    def tiers(self) -> list[TierSpec]:
        """The enabled tiers, fastest first (capacity 0 disables a tier)."""
        home = Path("~/.cache/adcloud/store").expanduser()
        if self.root is not None:
            defaults = [self.root / "mem", self.root / "ssd", self.root / "hdd"]
        else:
            defaults = [_default_mem_base() / "mem", home / "ssd", home / "hdd"]
        explicit = [self.mem_dir, self.ssd_dir, self.hdd_dir]
        capacities = [self.mem_capacity, self.ssd_capacity, self.hdd_capacity]
        out = []
        for name, given, default, cap in zip(
            TIER_NAMES, explicit, defaults, capacities, strict=True
        ):
            size = parse_size(cap)
            if size > 0:
                out.append(TierSpec(name, Path(given or default).expanduser(), size))
        if not out:
            raise ConfigError("store: every tier has capacity 0; give at least one a size")
        return out

    def metadata_dir(self) -> Path:
        """Where the shared catalog (SQLite) and the lock files live."""
        if self.meta_dir is not None:
            return Path(self.meta_dir).expanduser()
        if self.root is not None:
            return self.root
        return Path("~/.cache/adcloud/store").expanduser()

    def ufs_url(self) -> str:
        """The under-store URL (default: ``file://`` directory ``ufs`` beside the metadata)."""
        if self.ufs:
            return self.ufs
        return "file://" + str(self.metadata_dir() / "ufs")

    def default_write_type(self) -> WriteType:
        """``write_type`` as a :class:`WriteType`."""
        return WriteType.parse(self.write_type)
