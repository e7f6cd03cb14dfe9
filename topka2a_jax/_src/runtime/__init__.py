"""Processes: joining the multi-process runtime, the local launcher, the stall watch."""
