"""The decode step near the hardware: on CPU one native call per step (fused.py builds and loads
csrc/decode_step.cpp with the system's C++ compiler), on CUDA the step captured in CUDA graphs
(cuda_graphs.py)."""
