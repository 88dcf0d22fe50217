"""Event simulation of pipeline schedules: the schedules (schedule), their events (events) and a
plan's simulated timeline (plan), which checks the closed-form estimate and draws timelines."""
