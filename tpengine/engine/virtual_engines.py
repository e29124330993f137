"""The engine's ledger: one scheduler per batch that may be in flight (a virtual engine, as vLLM's first pipeline
engine had), so a sequence is in at most one of them. Without a pipeline there is one, and one step in flight.

Each virtual engine owns a range of the cache's block ids and its own prefix cache, and runs at most one step
at a time; with P stages, P steps are in flight, one per virtual engine, and every stage is busy. A request
goes, with all of its n completions, to the virtual engine whose prefix cache holds most of its prompt, the
least loaded among equals. The engine reads this as it reads one Scheduler: the counters are sums.
"""
from collections import deque

from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.engine.step_plan import StepPlan


class VirtualEngines:
    def __init__(self, num_virtual_engines: int, *, num_kvcache_blocks: int, **scheduler_settings):
        num_blocks = num_kvcache_blocks // num_virtual_engines
        if num_blocks < 1:
            raise ValueError(f"{num_kvcache_blocks} KV-cache blocks cannot give each of the pipeline's "
                             f"{num_virtual_engines} batches in flight a block; give the cache more memory")
        self.schedulers = [Scheduler(num_kvcache_blocks=num_blocks, first_block_id=i * num_blocks, virtual_engine=i,
                                     **scheduler_settings) for i in range(num_virtual_engines)]
        # steps submitted and not yet collected, oldest first: (scheduler, plan, when it was scheduled,
        # the scheduler's output-token count then)
        self.in_flight: deque[tuple[Scheduler, StepPlan, float, int]] = deque()

    def idle(self) -> list[Scheduler]:
        """The virtual engines without a step in flight, which may schedule one now."""
        busy = {id(entry[0]) for entry in self.in_flight}
        return [scheduler for scheduler in self.schedulers if id(scheduler) not in busy]

    # --- the Scheduler's face, for the engine ------------------------------------------------------

    @property
    def block_manager(self):
        """One virtual engine's ledger: each has the same size, and a request runs within one."""
        return self.schedulers[0].block_manager

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.schedulers[0].eos_token_ids

    @property
    def proposer(self):
        return self.schedulers[0].proposer

    @property
    def running(self) -> list[Sequence]:
        return [seq for scheduler in self.schedulers for seq in scheduler.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for scheduler in self.schedulers for seq in scheduler.waiting]

    def _sum(self, name: str) -> int:
        return sum(getattr(scheduler, name) for scheduler in self.schedulers)

    prefix_cache_queries = property(lambda self: self._sum("prefix_cache_queries"))
    prefix_cache_hits = property(lambda self: self._sum("prefix_cache_hits"))
    num_preemptions = property(lambda self: self._sum("num_preemptions"))
    num_output_tokens = property(lambda self: self._sum("num_output_tokens"))
    num_drafts = property(lambda self: self._sum("num_drafts"))
    num_draft_tokens = property(lambda self: self._sum("num_draft_tokens"))
    num_accepted_tokens = property(lambda self: self._sum("num_accepted_tokens"))

    @property
    def num_accepted_tokens_per_pos(self) -> list[int]:
        return [sum(column) for column in zip(*(s.num_accepted_tokens_per_pos for s in self.schedulers))]

    @property
    def kv_cache_usage(self) -> float:
        return sum(s.kv_cache_usage for s in self.schedulers) / len(self.schedulers)

    def is_finished(self) -> bool:
        return all(scheduler.is_finished() for scheduler in self.schedulers)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.schedulers[0].check_fits(num_prompt_tokens, max_tokens)

    def add(self, seq: Sequence) -> None:
        """Queue seq on its parent's virtual engine (n > 1 forks its prompt), else on the one whose prefix
        cache holds most of its prompt, the least loaded of those."""
        if seq.parent is not None:
            seq.virtual_engine = seq.parent.virtual_engine
        else:
            def preference(i: int) -> tuple[int, int]:
                scheduler = self.schedulers[i]
                return -scheduler.block_manager.num_cached_blocks(seq), len(scheduler.running) + len(scheduler.waiting)
            seq.virtual_engine = min(range(len(self.schedulers)), key=preference)
        self.schedulers[seq.virtual_engine].add(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        for scheduler in self.schedulers:
            seq = scheduler.abort(seq_id)
            if seq is not None:
                return seq
        return None

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        self.schedulers[seq.virtual_engine].truncate(seq, num_tokens)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        self.schedulers[seq.virtual_engine].finish(seq, reason, stop_reason)
