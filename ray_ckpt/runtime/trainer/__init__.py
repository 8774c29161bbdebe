"""The Ray runtime's side in the training process: the sink and its sender thread (the hand-off to this node's
persistence worker), the attach and restore helpers, the shared-memory arena and the drain watch of a training
process. Nothing here runs in an actor; the actors' code (``ray_ckpt.runtime``: persistence workers, coordinator,
replica) never imports this package.
"""
