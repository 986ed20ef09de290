"""Imported at start-up by the real-DeepSpeed reference runs only (``_ds_reference_env`` in
tests/test_deepspeed_checkpoints.py puts this folder on ``PYTHONPATH``).

DeepSpeed, like the scripts it runs, never destroys its gloo process group, and torch 2.13 then often aborts
the worker at exit ("terminate called without an active exception") after its work is done, failing the
reference run. zeroshard destroys the group at exit itself ([Note: destroy the group at exit] in
zeroshard/dist.py); this hook gives the reference runs the same clean exit, and nothing else.
"""

import atexit


def _destroy() -> None:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_destroy)
