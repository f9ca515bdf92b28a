"""Schedulers that start worker processes: local subprocesses and Slurm jobs."""
