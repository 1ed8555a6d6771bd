"""`zephon demo text` prints what a training engineer checks first: the wait, and the mixture realised
in the batches next to the weights asked for."""

from __future__ import annotations

import re

from zephon.demo._recipe import DEMO_MIXTURE
from zephon.demo._text import run_text_demo


def test_text_demo_prints_each_datasets_tokens_in_the_batches_beside_its_weight(capsys):
    assert run_text_demo(steps=2, runner="inline", parallelism=1, global_batch_size=16) == 0
    out = capsys.readouterr().out
    # Beside the wait's first microbatch, an unnamed "first batch after" read as the same time, 30x off.
    assert re.search(r"2 steps in [\d.]+ s \(first global batch after [\d.]+ s, planning included\)", out), out
    waited = re.search(r"waited for batches: [\d.]+ s inside next\(\) for (\d+) microbatches", out)
    assert waited and int(waited[1]) == 2 * 16 // 2, "every microbatch of the 2 steps (microbatches of 2 rows)"
    shares = {}
    for name, weight in DEMO_MIXTURE.items():
        line = re.search(rf"  {name} +read +(\d+) +emitted +(\d+) .* tokens +([\d,]+) \(([\d.]+) %, weight (\d+) %\)", out)
        assert line, f"no mixture line for {name}:\n{out}"
        assert int(line[3].replace(",", "")) > 0 and int(line[5]) == round(100 * weight)
        shares[name] = float(line[4])
    assert abs(sum(shares.values()) - 100) <= 0.1, shares
