"""The engine at run time: the round, CUDA graphs, tensor parallelism, Triton kernels, building an engine
from a configuration, the smoke test and the benchmark."""
