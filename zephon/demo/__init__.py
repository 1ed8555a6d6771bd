"""Demos on the shipped data: `zephon demo text` and `zephon demo elastic`."""
