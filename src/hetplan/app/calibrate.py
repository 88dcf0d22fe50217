"""``hetplan calibrate``: fit the cost model's free rates to measured steps.

Given plans and their measured step times (from ``hetplan tune``, ``hetplan
train --out`` summaries, or a CSV), find the ``Calibration`` (``cost/
calibration.py``: compute factor per GPU type, bandwidth factor per link
class, collective latency factor) under which the cost model predicts those
step times best, in the least-squares sense on log step time: an error of +20%
and one of -20% weigh the same whatever the step's length.

The fit is Levenberg-Marquardt on the log factors, with a finite-difference
Jacobian of the real cost model (so every effect the model has — overlap,
bubbles, latency per message — is fitted through, not a simplified copy).
A factor no measured plan depends on (no plan crosses nodes: the inter-node
bandwidth) cannot be learned; it is left at 1 and reported as such, never
guessed. A small pull towards 1 (``PRIOR_WEIGHT``) keeps factors that only
appear together (compute and bandwidth of one plan) from drifting apart.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hetplan.app.tune import read_measurements
from hetplan.cost.calibration import LINK_CLASSES, SCALE_RANGE, Calibration
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.errors import HetplanError
from hetplan.io.fields import listing, number, text, whole
from hetplan.plan.spec import Plan
from hetplan.plan.file import plan_file_from_data, read_plan_file
from hetplan.io.userfiles import read_json, read_text

# Weight of the pull of each log factor towards 0 (factor 1), relative to one
# plan's squared log error: small enough that a factor the measurements
# determine even weakly (the latency, a few % of a step) is recovered within
# 0.2% on exact synthetic steps (tests/test_calibrate.py), and still a
# well-posed solve when two factors only appear together.
PRIOR_WEIGHT = 1e-6
# Relative step of the finite-difference Jacobian (on log factors).
JACOBIAN_STEP = 1e-4
# A parameter whose Jacobian column is smaller than this (change of log step
# time per unit change of log factor, summed over plans) has no effect.
IDENTIFIABLE_MIN = 1e-3
MAX_ITERATIONS = 60
# Log factors the fit may reach: just inside ``SCALE_RANGE`` (a factor outside
# it is a broken measurement: that limit, not the fit, then says so).
LOG_BOUNDS = (math.log(SCALE_RANGE[0]) + 1e-9, math.log(SCALE_RANGE[1]) - 1e-9)


@dataclass(frozen=True)
class Observation:
    """One plan, what it was made for, and what its steps measured."""

    name: str
    workload: Workload
    plan: Plan
    measured_step_s: float
    measured_peak_memory_bytes: int | None = None


@dataclass(frozen=True)
class Parameter:
    """One fitted factor: its key in the Calibration and whether the plans tell it."""

    kind: str  # "compute", "bandwidth" or "latency"
    key: str  # GPU type, link class, or "" for latency

    @property
    def label(self) -> str:
        return {"compute": f"compute {self.key}", "bandwidth": f"{self.key}-node bandwidth",
                "latency": "collective latency"}[self.kind]


@dataclass(frozen=True)
class FitResult:
    calibration: Calibration
    parameters: tuple[Parameter, ...]
    identifiable: tuple[bool, ...]
    before_s: tuple[float, ...]  # predicted step per observation, uncalibrated
    after_s: tuple[float, ...]

    def errors(self, observations: Sequence[Observation], after: bool) -> list[float]:
        predicted = self.after_s if after else self.before_s
        return [p / o.measured_step_s - 1.0 for p, o in zip(predicted, observations)]


def calibration_of(parameters: Sequence[Parameter], log_factors: np.ndarray, source: str = "") -> Calibration:
    """The Calibration with these log factors."""
    compute: dict[str, float] = {}
    bandwidth: dict[str, float] = {}
    latency = 1.0
    for p, x in zip(parameters, log_factors.tolist()):
        factor = float(math.exp(x))
        if p.kind == "compute":
            compute[p.key] = factor
        elif p.kind == "bandwidth":
            bandwidth[p.key] = factor
        else:
            latency = factor
    return Calibration(compute, bandwidth, latency, source)


def parameters_for(observations: Sequence[Observation]) -> tuple[Parameter, ...]:
    """Every factor that could matter to these plans: each GPU type they run
    on, both link classes and the collective latency."""
    gpus = sorted({o.workload.cluster.devices[d].gpu.name for o in observations
                   for stage in o.plan.stages for d in stage.devices})
    return (tuple(Parameter("compute", g) for g in gpus) + tuple(Parameter("bandwidth", k) for k in LINK_CLASSES)
            + (Parameter("latency", ""),))


def predict_step_s(observation: Observation, calibration: Calibration | None) -> float:
    workload = dataclasses.replace(observation.workload, calibration=calibration)
    return float(CostModel(workload).estimate(observation.plan).iteration_time_s)


def _residuals(observations: Sequence[Observation], parameters: Sequence[Parameter], x: np.ndarray) -> np.ndarray:
    calibration = calibration_of(parameters, x)
    return np.array([math.log(predict_step_s(o, calibration) / o.measured_step_s) for o in observations])


def _jacobian(observations: Sequence[Observation], parameters: Sequence[Parameter], x: np.ndarray,
              base: np.ndarray) -> np.ndarray:
    columns = []
    for j in range(len(parameters)):
        moved = x.copy()
        moved[j] += JACOBIAN_STEP
        columns.append((_residuals(observations, parameters, moved) - base) / JACOBIAN_STEP)
    return np.stack(columns, axis=1)


def fit(observations: Sequence[Observation], progress: Callable[[str], None] | None = None) -> FitResult:
    """The Calibration that best predicts the observations (module docstring)."""
    if not observations:
        raise HetplanError("calibrate needs at least one measured plan")
    parameters = parameters_for(observations)
    n = len(parameters)
    x = np.zeros(n)
    residuals = _residuals(observations, parameters, x)
    jacobian = _jacobian(observations, parameters, x, residuals)
    identifiable = tuple(bool(v) for v in (np.abs(jacobian).sum(axis=0) >= IDENTIFIABLE_MIN))
    free = np.array(identifiable)
    damping = 1e-3

    def cost(r: np.ndarray, at: np.ndarray) -> float:
        return float(r @ r + PRIOR_WEIGHT * at @ at)

    current = cost(residuals, x)
    for iteration in range(MAX_ITERATIONS):
        if not free.any():
            break
        jf = jacobian[:, free]
        normal = jf.T @ jf + PRIOR_WEIGHT * np.eye(jf.shape[1])
        gradient = jf.T @ residuals + PRIOR_WEIGHT * x[free]
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
        trial = x.copy()
        trial[free] += step
        trial = np.clip(trial, *LOG_BOUNDS)  # a factor stays within what a calibration file may hold
        trial_residuals = _residuals(observations, parameters, trial)
        trial_cost = cost(trial_residuals, trial)
        if trial_cost < current:
            improvement = current - trial_cost
            x, residuals, current = trial, trial_residuals, trial_cost
            damping = max(damping / 3.0, 1e-9)
            if progress is not None:
                progress(f"calibrate: iteration {iteration + 1}, rms log error {math.sqrt(current / len(residuals)):.4f}")
            if improvement < 1e-12 or float(np.max(np.abs(step))) < 1e-7:
                break
            jacobian = _jacobian(observations, parameters, x, residuals)
        else:
            damping *= 10.0
            if damping > 1e8:
                break
    before = tuple(predict_step_s(o, None) for o in observations)
    calibration = calibration_of(parameters, np.where(free, x, 0.0),
                                 f"hetplan calibrate ({len(observations)} measured plan(s))")
    after = tuple(predict_step_s(o, calibration) for o in observations)
    return FitResult(calibration, parameters, identifiable, before, after)


# --- inputs ------------------------------------------------------------------------------
def load_observations(paths: Sequence[str], profile: Any = None) -> list[Observation]:
    """Measured plans from each file: a ``hetplan tune`` measurements file, a
    ``hetplan train --out`` ``summary.json``, or a CSV with columns
    ``plan,measured_step_s[,measured_peak_memory_bytes]`` (plan paths relative to the CSV)."""
    found: list[Observation] = []
    for path in paths:
        if path.lower().endswith(".csv"):
            found += _from_csv(path)
        else:
            found += _from_json(path)
    if not found:
        raise HetplanError("no measured plan in " + ", ".join(paths) + " (failed trials are left out)")
    if profile is not None:  # the plans were costed with the user's measured layer times
        found = [dataclasses.replace(o, workload=dataclasses.replace(o.workload, profile=profile)) for o in found]
    return found


def _observation(name: str, plan_file: Any, step_s: Any, peak: Any = None) -> Observation:
    step = number(f"{name}: measured step time", step_s)
    memory = whole(f"{name}: measured peak memory", peak, 0) if peak is not None else None
    return Observation(name, plan_file.workload(), plan_file.plan(), step, memory)


def _from_csv(path: str) -> list[Observation]:
    rows = list(csv.DictReader(read_text(path, "measurements CSV").splitlines()))
    if rows and ("plan" not in rows[0] or "measured_step_s" not in rows[0]):
        raise HetplanError(f"measurements CSV {path}: needs columns plan,measured_step_s "
                           "(and optionally measured_peak_memory_bytes)")
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for k, row in enumerate(rows, start=2):
        where = f"{path} line {k}"
        try:
            step = float(row["measured_step_s"])
            peak = int(row["measured_peak_memory_bytes"]) if row.get("measured_peak_memory_bytes") else None
        except (TypeError, ValueError):
            raise HetplanError(f"{where}: measured_step_s must be a number and measured_peak_memory_bytes "
                               "a whole number") from None
        plan_path = os.path.join(base, row["plan"] or "")
        out.append(_observation(where, read_plan_file(plan_path), step, peak))
    return out


def _from_json(path: str) -> list[Observation]:
    data = read_json(path, "measurements")
    if isinstance(data, dict) and data.get("format") == "hetplan-measurements":
        return [_observation(f"{path} trial {k + 1}", plan_file_from_data(f"{path} trial {k + 1}", t.plan_file),
                             t.measured_step_s, t.measured_peak_memory_bytes)
                for k, t in enumerate(read_measurements(path)) if t.ok]
    if isinstance(data, dict) and "step_times_s" in data and isinstance(data.get("config"), dict):
        return [_from_summary(path, data)]
    raise HetplanError(f"{path} is neither a 'hetplan tune' measurements file nor a 'hetplan train --out' "
                       "summary.json (nor a .csv)")


def _from_summary(path: str, data: dict[str, Any]) -> Observation:
    """A ``hetplan train`` summary: its plan file and the median step after the first (warm-up)."""
    times = [number(f"{path} step_times_s", t) for t in listing(f"{path} step_times_s", data["step_times_s"])]
    if len(times) < 2:
        raise HetplanError(f"{path}: needs at least 2 steps (the first is warm-up); train with --steps 3 or more")
    plan_path = text(f"{path} config.plan_path", data["config"].get("plan_path"))
    return _observation(path, read_plan_file(plan_path), statistics.median(times[1:]),
                        data.get("peak_memory_bytes"))


def fit_record(result: FitResult, observations: Sequence[Observation]) -> dict[str, Any]:
    """The fit as JSON (``hetplan calibrate --json``): the calibration, which
    factors the plans determined, and each plan's prediction before and after."""
    return {"calibration": result.calibration.to_dict(),
            "parameters": [{"name": p.label, "fitted": ok} for p, ok in zip(result.parameters, result.identifiable)],
            "plans": [{"name": o.name, "measured_step_s": o.measured_step_s, "before_s": b, "after_s": a}
                      for o, b, a in zip(observations, result.before_s, result.after_s)]}
