"""headroom's CUDA kernels: CUDA C sources beside this file, compiled by NVRTC (compile.py).

- paged_attention.cu: GQA-aware paged decode attention (single pass or split context) and the
  partition reduce; prefill reuses it one query row at a time.
- cache_ops.cu: `reshape_and_cache` (with fp8/int8 quantisation) and `copy_blocks`.
- common.cuh: shared device helpers; host_emulation.cuh: a CPU stand-in for the CUDA subset
  the kernels use, so tests run them without a GPU.
The launchers live in `headroom.engine.attention.cuda_backend`.
"""
