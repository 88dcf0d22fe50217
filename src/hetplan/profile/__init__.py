"""Measured layer costs: the ProfileDB format, Metis's profiling scheme, and the loader.

Measuring (``hetplan profile``: ``measure``, ``collectives``, ``cli``) needs
torch and is imported only by that command; this package imports without it.
"""

import os

from hetplan.profile.db import CollectiveFit, CollectivePoint, ProfileDB, ProfileEntry, read_profile_json
from hetplan.profile.metis import FORMAT as METIS_FORMAT
from hetplan.profile.metis import MetisProfileDB


def load_profile(path: str | os.PathLike[str]) -> ProfileDB:
    """A profile file in either format: Metis's (with layer-composition memory)
    or the plain one."""
    data = read_profile_json(os.fspath(path))
    if isinstance(data, dict) and data.get("format") == METIS_FORMAT:
        return MetisProfileDB.from_dict(data, f"profile {os.fspath(path)}")
    return ProfileDB.from_dict(data, f"profile {os.fspath(path)}")


__all__ = ["ProfileDB", "ProfileEntry", "CollectivePoint", "CollectiveFit", "MetisProfileDB", "load_profile"]
