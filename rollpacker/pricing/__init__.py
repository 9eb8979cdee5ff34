"""Pricing of runs' engine-step traces (``rollpacker-price``, docs/pricing.md).

Modules: ``trace`` (reading and checking ``engine_trace.jsonl``), ``cpu_model`` (constants
fitted on this machine), ``gpu_model`` (H800/H100/H200 from stated physical quantities),
``packing`` (the packing limit), ``price`` (a run priced per step: :func:`price_run`) and
``cli``.
"""
from rollpacker.pricing.cpu_model import CpuModel, fit_cpu_model
from rollpacker.pricing.gpu_model import GpuModel, gpu_model
from rollpacker.pricing.packing import PackingLimit, packing_limit
from rollpacker.pricing.price import RunPrice, StepPrice, price_run, price_trace
from rollpacker.pricing.trace import RunTrace, TraceError, read_trace

__all__ = ["CpuModel", "GpuModel", "PackingLimit", "RunPrice", "RunTrace", "StepPrice", "TraceError", "fit_cpu_model",
           "gpu_model", "packing_limit", "price_run", "price_trace", "read_trace"]
