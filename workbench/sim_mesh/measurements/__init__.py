"""Component measurements taken on real devices by ``benchmarks/gpu_components.py``
(GEMMs over a grid of shapes, attention kernels, memory-bound kernels, FP8 GEMMs, a
sustained GEMM with its clocks, whole layers), each file as the script wrote it, with
the software, driver and clocks it ran under.  A profile names its file in
``measured`` and the clock reads its rates from it (``sim_mesh.measured``)."""
