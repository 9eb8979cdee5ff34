"""Weight sync: the trainer's weights into the rollout engines after every step (and into new
engines on an elastic-TP switch).

* :mod:`.interface`: what a transport is (:class:`~.interface.WeightTransport`, its contract)
  and what it needs from the run (the trainer ranks as a ``WeightWriter``, device memory as a
  ``SyncColocation``, the multi-node ``FanOut``);
* :mod:`.factory`: ``rollout.weight_sync_format`` -> transport (:func:`~.factory.make_transport`,
  the one registry of transport classes);
* :mod:`.sync`: :class:`~.sync.WeightSync`, the one owner of weight movement the loop and the
  plug-ins call;
* the file formats: :mod:`.file_transports` (``hf``: rank 0 writes HF safetensors,
  :mod:`.hf_files`, every engine rank reads the whole model and vLLM's loaders cut their slice;
  ``sharded``: the resharder writes one file per engine rank, ``resharding.rollout_shards``, and
  each engine rank reloads only its own, ``rollout.worker.vllm_worker_ext``), the directories they go
  through (:mod:`.sync_dir`, ``/dev/shm`` by default) and their copy to other nodes
  (:mod:`.fanout`);
* ``push/``: the tensor push (``tensor``, the default): every trainer rank sends each engine rank
  exactly its slice, cut from its own Megatron shards, in bounded buckets through vLLM's
  weight-transfer API (shared memory / CUDA IPC on a node, gloo / NCCL across nodes); the
  engines load it in place. No files, no fan-out; new engines of an elastic switch start with
  dummy weights and get a push. Its package docstring maps the three ends.

With ``rollout.quantization`` the sharded files are quantized by the resharder
(``quantization.scheme.quantize_tensors``) and the tensor push by the receiving workers
(``quantize_slices``); the HF files carry the trainer's dtype.
"""
