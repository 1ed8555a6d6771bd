"""The VLM demo and its recipe live in `vlm._demo`; `zephon demo vlm` finds them through the
`zephon.demos` entry point, so the core never imports `vlm`. This name is kept for callers that
import the recipe from here (`from zephon.demo._vlm import vlm_pipeline`); new code should import
`vlm._demo`.
"""

from __future__ import annotations

from vlm._demo import (
    add_vlm_parser,
    draw_batch,
    placeholders_for,
    position_kinds,
    run_vlm_demo,
    vlm_pipeline,
)

__all__ = ["add_vlm_parser", "draw_batch", "placeholders_for", "position_kinds", "run_vlm_demo", "vlm_pipeline"]
