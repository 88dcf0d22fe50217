"""Deterministic effort limits: a search budget counts work, never seconds.

A planner whose result depended on wall-clock time would return different
plans on a loaded machine. Budgets here count units of work (stage mappings
searched, DP states, candidates costed); the same input always does the same
work and returns the same plan. When a budget cuts a search short the plan
says so in its notes (and ``--json`` carries them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkBudget:
    """``limit`` units of work (0: unlimited); ``spend`` says whether there was room."""

    limit: int
    what: str
    used: int = 0
    exhausted: bool = False

    def spend(self, units: int = 1) -> bool:
        """Take ``units`` of work; False (and ``exhausted``) once the limit is reached."""
        if self.limit and self.used + units > self.limit:
            self.exhausted = True
            return False
        self.used += units
        return True

    def note(self, planner: str) -> str:
        """The sentence a plan carries when this budget cut its search."""
        return (f"{planner}: search stopped at its work budget of {self.limit:,} {self.what}; "
                "these are the best plans found within it (raise the budget to search further)")
