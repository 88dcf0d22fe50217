"""A plan and what it is made for: the Plan types (spec), their file format (file), the checks of a plan
against its model and cluster (validate) and the Workload a plan is made and costed for (workload)."""
