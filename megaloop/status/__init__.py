"""`python -m megaloop status RUN_DIR`: what a run is doing, read from its folder alone (no process group, no
connection to the job): its state, each rank's progress from its heartbeat file, the stragglers and hung ranks of the
current attempt, and the restarts and rollbacks that metrics.jsonl recorded. An application on top of the trainer
(megaloop.train never imports it).

attempt.py picks the current attempt's heartbeat lines, assess.py judges them (stragglers, hung ranks, the run's
state), folder.py reads the rest of the run folder (config, markers, metrics, Slurm logs), cli.py prints it.
"""
