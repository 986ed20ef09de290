"""The sharded training step: everything between a model's parameters and one optimizer step.

Nothing here reads the config, touches the file system, knows about DeepSpeed's names or imports anything
outside ``core/`` (``tests/test_imports.py``): ``zeroshard/runtime/build.py`` builds these pieces from plain
values read from the validated config (``zeroshard/core_config.py``), and the engine
(``zeroshard/runtime/engine.py``) drives them.

- ``layout``: pure shard arithmetic (offsets, padding, which rank owns which range).
- ``units``, ``flat_param``: the parameters communicated together and one unit's buffers and shard state.
- ``partitioned``: parameters ``zero.Init`` keeps partitioned until the units take them.
- ``stages``: what each ZeRO stage shards and when it communicates, as data.
- ``grad_sync``, ``inflight``: gradient reduction.
- ``stage3/``: stage-3 gathering (the gatherer and its helpers: prefetch, spent units, saved views, parameters
  used outside their module, the gather check, and the marks users put on modules).
- ``optimizer``, ``precision``, ``loss_scaler``: the sharded optimizer step and its dtype policy.
- ``comm``, ``pending``: the one module that calls collectives, and waiting for them (timeouts, counts).
- ``liveness``: ``CollectiveError`` and the ``Monitor`` protocol, what ``comm`` and ``pending`` tell the
  liveness records (the records, the heartbeat and the naming of dead or stuck peers are in ``watchdog/``).
- ``buffers``, ``memory``: the buffer pool, the accounting.
"""
