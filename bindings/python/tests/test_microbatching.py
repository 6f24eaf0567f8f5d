"""Session(microbatching=...): "adaptive" (the default) cuts a call that arrives while others are
in flight only as far as one micro-batch per stage needs; "fixed" cuts every call into
`microbatches`. Results are the same; the stage statistics show the difference."""

import pytest
from conftest import WAIT_LIMIT_S, assert_close, held_session


@pytest.mark.parametrize(
    "mode, per_later_call",
    [(None, 1), ("adaptive", 1), ("fixed", 2)],
    ids=["default", "adaptive", "fixed"],
)
def test_call_arriving_while_another_runs(gate, gated_plan, gated_inputs, gated_expected, mode, per_later_call):
    # 2 stages, 2 micro-batches per call. The first call finds the pipeline empty and gets both;
    # the second arrives while the first's 2 micro-batches are held inside (one at stage 0's
    # gate, one queued behind it), which already keeps both stages busy, so adaptive cuts it
    # into 1 (the minimum) and fixed into 2.
    x = gated_inputs["x"]
    key = gate.new_key()
    kwargs = {} if mode is None else {"microbatching": mode}
    with held_session(gated_plan, gate, microbatches=2, **kwargs) as session:
        first = session.submit(x, n=key)
        gate.wait(key, "stage0")
        second = session.submit(x, n=0)
        gate.open(key)
        assert_close(first.wait(timeout=WAIT_LIMIT_S)["output"], gated_expected)
        assert_close(second.wait(timeout=WAIT_LIMIT_S)["output"], gated_expected)  # however it was cut
        counts = [s["microbatches"] for s in session.stats()]
        assert counts == [2 + per_later_call] * 2
