"""What users call to train: the steps and placement on a mesh."""
