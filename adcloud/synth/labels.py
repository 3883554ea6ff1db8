"""Semantic classes and surface materials of the synthetic world.

The ids of :class:`Label` are stored in the LiDAR ``label`` field, the camera label
image and the truth raster; they are part of the truth format (version 1) and never
change meaning.  New classes only ever get new ids.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["LABEL_COLORS", "RANGE_NOISE_EXTRA_M", "Label"]


class Label(IntEnum):
    """Semantic class of a world surface (``uint16`` LiDAR field ``label``, ``uint8`` images).

    - ``UNLABELED`` (0): no surface (sky, out of range) -- never on a LiDAR point;
    - ``ROAD`` (1): asphalt of a carriageway, intersections included;
    - ``LANE_MARKING`` (2): painted lines on the road (bright: reflectance 0.55--0.8);
    - ``CURB`` (3): the 0.15 m high curb face and its 0.15 m wide top;
    - ``SIDEWALK`` (4): raised concrete beside the curb;
    - ``TERRAIN`` (5): grass and soil, everywhere off the road and sidewalk;
    - ``BUILDING`` (6): buildings and walls;
    - ``POLE`` (7): street-light poles and the posts of traffic signs;
    - ``SIGN`` (8): traffic-sign plates (retro-reflective: reflectance 0.9);
    - ``VEGETATION`` (9): tree trunks, canopies and bushes;
    - ``VEHICLE`` (10): other vehicles, parked or moving.
    """

    UNLABELED = 0
    ROAD = 1
    LANE_MARKING = 2
    CURB = 3
    SIDEWALK = 4
    TERRAIN = 5
    BUILDING = 6
    POLE = 7
    SIGN = 8
    VEGETATION = 9
    VEHICLE = 10


#: Extra 1-sigma LiDAR range noise (m) per label, added in quadrature to the configured
#: noise: leaves and grass scatter the beam.  Index with a label id.
RANGE_NOISE_EXTRA_M: np.ndarray = np.zeros(len(Label), dtype=np.float32)
RANGE_NOISE_EXTRA_M[Label.VEGETATION] = 0.05
RANGE_NOISE_EXTRA_M.setflags(write=False)

#: Camera albedo (RGB, 0..1) per label; ground labels are modulated by reflectance.
LABEL_COLORS: np.ndarray = np.array(
    [
        (0.55, 0.70, 0.90),  # UNLABELED: sky
        (0.30, 0.30, 0.32),  # ROAD
        (0.95, 0.95, 0.92),  # LANE_MARKING
        (0.70, 0.70, 0.68),  # CURB
        (0.62, 0.60, 0.58),  # SIDEWALK
        (0.35, 0.50, 0.25),  # TERRAIN
        (0.70, 0.62, 0.55),  # BUILDING
        (0.55, 0.55, 0.58),  # POLE
        (0.90, 0.20, 0.15),  # SIGN
        (0.20, 0.45, 0.18),  # VEGETATION
        (0.25, 0.35, 0.70),  # VEHICLE
    ],
    dtype=np.float32,
)
LABEL_COLORS.setflags(write=False)
