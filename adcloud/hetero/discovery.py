"""``python -m adcloud.hetero.discovery [gpu|fpga]``: Spark's resource-discovery JSON.

What ``deploy/discover_opencl.sh`` runs: prints ``{"name": ..., "addresses": [...]}`` for
the OpenCL devices of the resource's kinds (:func:`adcloud.hetero.devices.discover`, with
:class:`~adcloud.hetero.devices.HeteroSettings` from ``ADCLOUD_HETERO_*``) and exits 0, or
prints the reason to stderr and exits 1.  When it finds no GPU while a GPU driver's OpenCL
library is on the machine unregistered (:func:`~adcloud.hetero.devices.unregistered_icds`),
it says so on stderr, which Spark keeps in the worker's log; so it does for a device that
``ADCLOUD_HETERO_SPLIT`` asks to split but that cannot be split (it is listed whole).
Kept out of the package's imports so that ``python -m`` runs it cleanly.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from adcloud.errors import AdcloudError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the discovery document for ``argv[0]`` (default ``gpu``); the exit status."""
    from adcloud.hetero.devices import (  # noqa: PLC0415
        HeteroSettings,
        discover,
        icd_registration,
        unregistered_icds,
    )

    args = list(sys.argv[1:] if argv is None else argv)
    resource = args[0] if args else "gpu"
    try:
        settings = HeteroSettings.load()
        document = discover(resource, settings)
    except AdcloudError as err:
        sys.stderr.write(f"discover_opencl: {err}\n")
        return 1
    sys.stdout.write(json.dumps(document) + "\n")
    whole = [a for a in document["addresses"] if "/" not in a]
    if settings.split > 1 and whole:
        # Spark only saw fewer addresses than it was configured for, and no reason why
        sys.stderr.write(
            f"discover_opencl: {', '.join(whole)} cannot be split into {settings.split} "
            "equal sub-devices (ADCLOUD_HETERO_SPLIT; a device splits into at most its "
            "compute units, and only where its driver can); listed whole\n"
        )
    if resource == "gpu" and not document["addresses"]:
        for path in unregistered_icds():
            sys.stderr.write(
                f"discover_opencl: no GPU listed, but {path} (a GPU driver's OpenCL library) "
                f"is here unregistered; register it: {icd_registration(path)}\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
