"""Checkpoints: Orbax saves, the layout description, resizing, integrity."""
