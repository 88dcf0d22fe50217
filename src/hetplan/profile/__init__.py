"""Measured layer costs (ProfileDB) and the profiler that measures them."""

from hetplan.profile.db import ProfileDB, ProfileEntry

__all__ = ["ProfileDB", "ProfileEntry"]
