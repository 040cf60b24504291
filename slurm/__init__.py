"""Slurm launchers for megaloop: sbatch scripts that survive preemption and time limits (agreed stop, checkpoint,
requeue, resume), isoFLOP sweeps as job arrays, and the torchrun wrapper the scripts start on every node.
Renders commands that run megaloop's entry points; never imports megaloop. See slurm/README.md."""
