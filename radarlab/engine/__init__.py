"""A small serving engine: requests, sampling, an FCFS continuous-batching scheduler over the paged
KV cache (chunked prefill, preemption by recompute, prefix caching), and the Engine that drives it.

Named after vLLM's pieces (vllm/sampling_params.py, vllm/v1/request.py, vllm/v1/core/sched/scheduler.py,
vllm/v1/engine/llm_engine.py); notebook 05 builds on it.
"""
from radarlab.engine.llm_engine import Engine, RequestOutput
from radarlab.engine.params import SamplingParams
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.sampler import sample
from radarlab.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["Engine", "RequestOutput", "SamplingParams", "Request", "RequestStatus", "sample", "Scheduler",
           "SchedulerOutput"]
