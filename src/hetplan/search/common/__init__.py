"""What every planner shares: degree rules, layer splits, placements, the exact
pipeline partition and deterministic work budgets."""
