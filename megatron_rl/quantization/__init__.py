"""Low-precision rollout (``rollout.quantization``): the trainer's weights quantized on their way
to the engines at every weight sync, in a checkpoint format vLLM loads.

* :mod:`.scheme`: what is quantized and how, as one pure step over ``(name, tensor)`` pairs in
  the engine's naming (HF names or vLLM's fused ones): :func:`~.scheme.quantize_tensors`. Every
  weight transport applies it to the tensors it moves; nothing else changes for the transport.
* :mod:`.modelopt_ops`: the per-tensor kernels (nvidia-modelopt's INT8 / FP8 E4M3 quantizers),
  imported only when quantization is on.
* :mod:`.engine_format`: the engine side of the format: ``quantization_config`` for the
  engine's ``config.json`` (compressed-tensors W8A8 for int8, modelopt's FP8 export for fp8), the
  quantized start-up checkpoint, the extra state-dict entries of a quantized engine.

Inside vLLM's worker processes (the in-place reload of a quantized model, the per-rank scale
pieces of the sharded reload, a probe of the kernels the engine runs) is
``megatron_rl.rollout.worker.quantized_engine``; where each transport applies the step is in
``megatron_rl.rollout.weight_sync.sync``'s docstring.
"""
