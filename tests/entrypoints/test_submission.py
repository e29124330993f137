"""A submission keeps only the newest output of each prompt: a client that reads slowly costs one output
per prompt, whatever the number of steps it fell behind."""
import asyncio

from tpengine.entrypoints.async_engine import Submission
from tpengine.outputs import CompletionOutput, RequestOutput


def output(step: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index=0, text="x" * step, token_ids=list(range(step)),
                                  finish_reason="length" if finished else None)
    return RequestOutput(request_id=0, prompt=None, prompt_token_ids=[1], outputs=[completion], finished=finished,
                         num_cached_tokens=0)


def test_outputs_delivered_while_nobody_reads_are_replaced_by_the_newest():
    async def scenario():
        submission = Submission(engine=None, key=0, num_prompts=2)
        for step in range(1, 1001):  # a thousand steps while the client reads nothing
            submission.deliver(0, output(step))
            submission.deliver(1, output(step))
        assert len(submission._latest) == 2
        seen = []
        submission.deliver(1, output(1001, finished=True))
        async for latest in submission:
            seen.append({index: len(out.token_ids) for index, out in latest.items()})
            if not submission.finished:
                submission.deliver(0, output(1002, finished=True))
        return seen

    assert asyncio.run(scenario()) == [{0: 1000, 1: 1001}, {0: 1002}]


def test_a_failure_reaches_the_reader():
    async def scenario():
        submission = Submission(engine=None, key=0, num_prompts=1)
        submission.deliver(0, output(3))
        submission.fail(RuntimeError("engine down"))
        try:
            async for _ in submission:
                pass
        except RuntimeError as e:
            return str(e)

    assert asyncio.run(scenario()) == "engine down"


def test_by_step_a_slow_reader_takes_each_step_s_delta_apart_in_order():
    # a thinking budget counts tokens as they come: two steps delivered before a read must not arrive joined
    async def scenario():
        submission = Submission(engine=None, key=0, num_prompts=2, delta=True, by_step=True)
        for step in (1, 2, 3):
            submission.deliver(0, output(1, finished=step == 3))
            submission.deliver(1, output(1, finished=step == 3))
        return [{index: len(out.token_ids) for index, out in latest.items()} async for latest in submission]

    assert asyncio.run(scenario()) == [{0: 1, 1: 1}] * 3
