"""``deepspeed.profiling``: DeepSpeed's FLOPs profiler is out of scope; its names import, using one raises."""
