"""Parallel strategies built on DistTensor, the collectives and the modeled clock:
data parallel, ZeRO, tensor and sequence parallel, pipeline, recompute, and
compute/communication overlap (``overlap.py``: decomposed collectives;
``overlap_sweep.py``: their hidden share against k, sizes and profiles;
``overlap_multicopy.py``: MindSpore's multi-copy layer).
"""
