"""What users call to train: the steps, placement on a mesh, checkpoints, processes."""
