"""A small serving engine: requests, an FCFS continuous-batching scheduler over the paged KV cache
(chunked prefill, preemption by recompute, prefix caching), and the Engine that drives it.

Named after vLLM's pieces (vllm/v1/request.py, vllm/v1/core/sched/scheduler.py,
vllm/v1/engine/llm_engine.py); notebook 05 builds on it. SamplingParams lives in radarlab.sample
(it is what the sampler reads) and is offered here too, as `from vllm import LLM, SamplingParams`.
"""
from radarlab.engine.llm_engine import Engine, RequestOutput
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.scheduler import Scheduler, SchedulerOutput
from radarlab.sample.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "Request", "RequestStatus", "Scheduler",
           "SchedulerOutput"]
