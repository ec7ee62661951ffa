"""A small serving engine: requests, sampling, an FCFS continuous-batching scheduler over the paged
KV cache (chunked prefill, preemption by recompute, prefix caching), and the Engine that drives it.

Named after vLLM's pieces (vllm/sampling_params.py, vllm/v1/request.py, vllm/v1/core/sched/scheduler.py,
vllm/v1/engine/llm_engine.py); notebook 05 builds on it.

Engine and RequestOutput load on first use: the engine imports radarlab.spec (the rejection sampler,
the proposers), which imports this package's sampler, so loading llm_engine here would make
`import radarlab.spec.rejection` circular.
"""
from radarlab.engine.params import SamplingParams
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.sampler import sample
from radarlab.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["Engine", "RequestOutput", "SamplingParams", "Request", "RequestStatus", "sample", "Scheduler",
           "SchedulerOutput"]


def __getattr__(name: str):
    if name in ("Engine", "RequestOutput"):
        from radarlab.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
