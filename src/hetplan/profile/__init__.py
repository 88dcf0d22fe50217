"""Measured layer costs as the planner reads them: the ProfileDB format,
Metis's profiling scheme, and the loader.

File formats only, torch-free: the measuring half (``hetplan profile``) is
``hetplan.runtime.profiling``, which writes these files; nothing here imports
the runtime.
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
