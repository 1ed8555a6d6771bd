"""The race: Zephon against its peers on the same data and the same work (`python -m benchmarks.race`).

See benchmarks/README.md for what is measured, how, and the latest results.
"""
