"""Work planning: what is read, in which order, by which lane."""

from ._estimation import TokenEstimation, TokenStats
from ._plan import (
    EMPTY_SLOTS_LIMIT,
    Flush,
    MixturePlan,
    ScheduledMixtureWorkSource,
    StaticMixtureWorkSource,
    WorkPlan,
    WorkSource,
    lane_plan,
)

__all__ = [
    "EMPTY_SLOTS_LIMIT",
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
