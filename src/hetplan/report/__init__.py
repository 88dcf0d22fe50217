"""Text tables and JSON for plans, estimates and comparisons."""
