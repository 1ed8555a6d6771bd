"""Hypothesis budgets of the fuzz tests.

In CI every fuzz test runs a modest number of examples (its `ci` budget, a few dozen) so that the
whole directory takes well under a minute. To fuzz for longer, load the `long` profile:

    python -m pytest tests/fuzz --hypothesis-profile=long          # 2,000 examples per test
    python -m pytest tests/fuzz --hypothesis-profile=long --hypothesis-seed=1234 -x

(Give the `tests/fuzz` path on the command line: pytest reads this file, which registers the
profile, only for the directories it is asked to collect.) The `long` profile keeps the suite's
`zephon` settings (no deadline, the reproduction blob printed on failure).
"""

from __future__ import annotations

from hypothesis import settings

LONG_EXAMPLES = 2000

settings.register_profile("long", parent=settings.get_profile("zephon"), max_examples=LONG_EXAMPLES)


def fuzz_settings(ci: int, **overrides) -> settings:
    """`ci` examples normally; the `long` profile's count when it is loaded."""
    examples = LONG_EXAMPLES if settings.get_current_profile_name() == "long" else ci
    return settings(max_examples=examples, **overrides)
