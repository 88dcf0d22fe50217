"""Baselines the papers compare against: Megatron-LM's heuristics, every uniform
3D plan, AMP's random search, the average-GPU abstraction, and the fixed
strategies of Galvatron-BMW's tables."""
