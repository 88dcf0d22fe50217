"""AMP (Li et al., NeurIPS 2022): Algorithm 1 ranked by AMP's own cost (eq. 3-5)."""

from hetplan.search.amp.objective import AmpCost, AmpCostModel, AmpTerms
from hetplan.search.amp.planner import AmpCandidate, AMPPlanner

__all__ = ["AMPPlanner", "AmpCandidate", "AmpCost", "AmpCostModel", "AmpTerms"]
