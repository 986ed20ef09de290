"""DeepSpeed's ZeRO checkpoint format: read, indexed, written, and converted to zeroshard's own.

- ``reader``: a DeepSpeed checkpoint read as any-range tensors, so zeroshard's loader reshards it
  ([Note: DeepSpeed checkpoint layout]); ``open_reader`` opens either format.
- ``index``: where each parameter's elements sit in DeepSpeed's files.
- ``pickles``: DeepSpeed's ``*.pt`` pickles read without running code from them, and written
  ([Note: DeepSpeed pickles]).
- ``writer``: any checkpoint zeroshard reads, written in DeepSpeed's layout for a chosen world size.
- ``to_zeroshard``: a DeepSpeed checkpoint rewritten in zeroshard's own format, offline.

The public entry points are ``zeroshard.checkpoint``'s (``convert_to_deepspeed``, ``convert_to_zeroshard``,
``open_checkpoint``) and the engine's ``save_checkpoint``/``load_checkpoint``.
"""
