"""Stage 3: each module's parameters gathered just before it computes and released after.

- ``gatherer``: :class:`~zeroshard.core.stage3.gatherer.ParameterGatherer`, the module hooks and the
  gathered/released state of the stage-3 units ([Note: stage-3 lifecycle], [Note: recompute],
  [Note: trim before the backward's end]); it drives the helpers below.
- ``phase``: the gatherer's phases and every transition between them ([Note: gatherer phases]).
- ``coupling``: what the gradient reducer needs from the gatherer, passed at construction ([Note: reducer and
  gatherer]).
- ``prefetch``: which units to gather ahead and which to keep, from the previous step's order
  ([Note: prefetch schedule]).
- ``saved_views``: tensors autograd saves from gathered buffers kept as references ([Note: saved views]).
- ``spent_units``: units that backward has finished reading, released before their gradients
  ([Note: spent units]).
- ``external_access``: parameters read outside their own module, found and gathered on first use
  ([Note: external parameters]).
- ``gather_check``: every rank about to gather the same units, or an error naming them ([Note: gather check]).
- ``hook_tools``: helpers for the module and tensor hooks (the tensors of a module's output, eager hooks).
- ``module_marks``: what users declare on modules (leaf modules, external parameters), read when the units
  are built.
"""
