"""Work planning: what is read, in which order, by which lane."""

from ._estimation import TokenEstimation, TokenStats
from ._plan import (
    Flush,
    MixturePlan,
    ScheduledMixtureWorkSource,
    StaticMixtureWorkSource,
    WorkPlan,
    WorkSource,
    lane_plan,
)

__all__ = [
    "Flush",
    "MixturePlan",
    "ScheduledMixtureWorkSource",
    "StaticMixtureWorkSource",
    "TokenEstimation",
    "TokenStats",
    "WorkPlan",
    "WorkSource",
    "lane_plan",
]
