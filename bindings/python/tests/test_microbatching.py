"""Session(microbatching=...): "adaptive" (the default) cuts a call that arrives while others are
in flight only as far as one micro-batch per stage needs; "fixed" cuts every call into
`microbatches`. Results are the same; the stage statistics show the difference."""
import pytest
from conftest import QUICK_N, assert_close

# slow_loop with this n takes a few tenths of a second per micro-batch and stage: long enough
# that a call started right after it always finds it still in the pipeline.
BUSY_N = 20_000


@pytest.mark.parametrize(
    "mode, per_later_call",
    [(None, 1), ("adaptive", 1), ("fixed", 2)],
    ids=["default", "adaptive", "fixed"],
)
def test_call_arriving_while_another_runs(slow_plan, slow_inputs, slow_expected, mode, per_later_call):
    # 2 stages, 2 micro-batches per call. The first call finds the pipeline empty and gets both;
    # the second arrives while the first's 2 micro-batches are inside, which already keeps both
    # stages busy, so adaptive cuts it into 1 (the minimum) and fixed into 2.
    kwargs = {} if mode is None else {"microbatching": mode}
    with slow_plan.session(microbatches=2, input_specs={"n": "replicate"}, **kwargs) as session:
        first = session.submit(slow_inputs["x"], n=BUSY_N)
        second = session.run(slow_inputs["x"], n=QUICK_N, timeout=120)
        first.wait(timeout=120)
        assert_close(second["output"], slow_expected)  # however it was cut, the same result
        counts = [s["microbatches"] for s in session.stats()]
        assert counts == [2 + per_later_call] * 2

