"""The tensor weight push (``rollout.weight_sync_format=tensor``), by the end it runs at:

* the driver: :mod:`.transport` (:class:`~.transport.TensorTransport`: sets a push up for a set
  of engines and runs each sync), wired as :mod:`.protocol` says (the ``PushSpec`` every end
  agrees on; :mod:`.topology` pairs the processes: by node on CPU, by GPU UUID on GPU), engines
  started for a push from :mod:`.start_dir`;
* the trainer ranks: :mod:`.sender` (``PushSender``, driven by ``training.weight_push``);
* the engine: :mod:`.engine_methods` (the push methods of ``VLLMEngine`` on vLLM's
  weight-transfer API) and, in each vLLM worker, :mod:`megatron_rl.rollout.worker.push_receiver`
  (the weight-transfer backend that receives the buckets and loads them in place; it lives with
  the other code vLLM imports into its workers);
* the wires between trainer ranks and workers: :mod:`.channels` (CPU: shared-memory rings,
  gloo) and :mod:`.channels_gpu` (CUDA IPC, NCCL).
"""
