"""The runtime: the engine a user steps, and how ``initialize`` assembles it from the config and core.

``build`` turns a config and a model into units, reducer, gatherer and optimizer; ``engine`` is the training
loop's object (forward, backward, step), with its DeepSpeed surface (``surface``, ``methods``, ``queries``),
checkpoint methods (``checkpointing``), the data loader (``data``), the non-finite policy, the state-dict
hooks and the cross-rank agreement checks beside it.
"""
