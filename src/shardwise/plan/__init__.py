"""Planning: which parallel layouts fit a workload's memory on given hardware, and which is fastest.

`plan(PlanRequest(...))` enumerates DP x TP x PP, ZeRO stages, recompute, micro-batch sizes and
pipeline schedules, predicts each step's time (`cost.predict_step`), keeps those whose estimated
memory (`shardwise.memory.estimate`) fits, and ranks them; `profile` runs the best ones for real and
calibrates the prediction. `hardware` is the device catalogue.
"""

from .cost import StepTime, physical_limit, predict_step
from .hardware import CATALOGUE, Hardware, get_hardware, load_hardware_file
from .search import Candidate, Layout, PlanRequest, PlanResult, plan, workload_config

__all__ = ["CATALOGUE", "Candidate", "Hardware", "Layout", "PlanRequest", "PlanResult", "StepTime", "get_hardware",
           "load_hardware_file", "physical_limit", "plan", "predict_step", "workload_config"]
