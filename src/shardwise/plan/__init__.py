"""Planning: which parallel layouts fit a workload's memory on given hardware, and which is fastest.

`plan(PlanRequest(...))` enumerates DP x TP x PP, ZeRO stages, recompute, micro-batch sizes and
pipeline schedules, predicts each step's time (`cost.predict_step`), keeps those whose estimated
memory (`shardwise.memory.estimate`) fits, and ranks them; `report.format_plan` turns the result
into text; `profile` runs the best ones for real and calibrates the prediction; `calibrate`
measures this machine's links. The device catalogue is `shardwise.hardware`.
"""

from ..step_time import StepTime, physical_limit, predict_step
from .report import format_plan
from .search import Candidate, Layout, PlanRequest, PlanResult, plan, workload_config

__all__ = ["Candidate", "Layout", "PlanRequest", "PlanResult", "StepTime", "format_plan", "physical_limit", "plan",
           "predict_step", "workload_config"]
