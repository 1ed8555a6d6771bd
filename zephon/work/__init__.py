"""Work planning: what is read, in which order, by which lane."""

from ._estimation import TokenEstimation, TokenStats
from ._plan import Flush, MixturePlan, StaticMixtureWorkSource, WorkPlan, WorkSource, lane_plan

__all__ = [
    "Flush",
    "MixturePlan",
    "StaticMixtureWorkSource",
    "TokenEstimation",
    "TokenStats",
    "WorkPlan",
    "WorkSource",
    "lane_plan",
]
