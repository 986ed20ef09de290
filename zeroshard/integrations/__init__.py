"""Ways into zeroshard from training frameworks that need no ``import deepspeed`` alias.

``zeroshard.integrations.lightning``: ``ZeroshardStrategy`` for Lightning (``zeroshard[lightning]``).
Each submodule imports its framework; this package imports none of them.
"""
