"""Running a step on the device: the model runner, its loader and memory budget, and the faster
forward paths (CUDA graphs, the CPU's compiled decode steps)."""
