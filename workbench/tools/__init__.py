"""Scripts run under torchrun that check the library on real processes (not imported by
the library itself): ``python -m torch.distributed.run --nproc-per-node 2 -m
workbench.tools.activation_check``."""
