"""Runtime: WHO runs it. One rank's schedule over ``torch.distributed``, knowing no Lightning.

- the engine: :mod:`.engine` (one rank's action list, step by step) and :mod:`.engine_step`
  (one step's state: microbatches, stash, receive window);
- point-to-point: :mod:`.p2p_wire` (message format, specs, pending sends and receives),
  :mod:`.p2p` (the communicator), :mod:`.receive_window`, :mod:`.p2p_order` (one global
  message order), :mod:`.nccl_emulation` (NCCL's rules on gloo, for tests);
- the split backward of zero-bubble schedules: :mod:`.split_backward` (I and W),
  :mod:`.weight_grad_direct` (W without the graph), :mod:`.saved_for_w`;
- recompute: :mod:`.recompute` (the mechanism) and :mod:`.recompute_probe` (what one layer
  saves, as the recompute planner needs it measured);
- gradients and numbers: :mod:`.grad_sync` (deferred data-parallel all-reduce, tied weights,
  global norm), :mod:`.fsdp_chunks` (FSDP2 per chunk, its reduce-scatter at each chunk's last
  backward), :mod:`.numerics` (where a NaN first appeared), :mod:`.microbatch`,
  :mod:`.records` (what a step did);
- failures: :mod:`.errors`, :mod:`.failure` (abort channel and hang watchdog),
  :mod:`.heartbeats` (process liveness), :mod:`.local_process` (what ``/proc`` says),
  :mod:`.store_host` (the job's store in a process of its own, outside rank 0),
  :mod:`.processes` (ending a job's processes together).

May import: :mod:`lightning_pp.schedules` and :mod:`lightning_pp.layout`. Never Lightning.
"""
