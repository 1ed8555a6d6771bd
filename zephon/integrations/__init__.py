"""Integrations of Zephon loaders with training frameworks.

- `zephon.integrations.torchtitan`: `ZephonDataLoader` and `DataRecipe` for TorchTitan 0.3.0.

Each integration is its own module, imported on demand, so `import zephon` never imports a
training framework (or torch).
"""

from __future__ import annotations

__all__ = ["torchtitan"]
