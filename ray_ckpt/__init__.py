"""ray_ckpt: per-iteration, bit-exact differential checkpointing for distributed PyTorch on Ray."""
