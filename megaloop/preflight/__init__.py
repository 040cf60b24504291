"""`python -m megaloop preflight`: every communication path of a training job, run once on this machine or cluster
before the job itself, each checked against a single-process result or a formula, with its measured bus bandwidth.

- `cli`: the command (launches the workers with torchrun's agent, or is a worker when a launcher started it);
- `worker`: one rank's run of every path, the results agreed over the world and printed by rank 0;
- `paths_train`: tp2 x dp and pp2 x dp training steps against one process, and a dp checkpoint resumed bit for bit;
- `paths_comm`: the ring pipeline with parcae-1_3b-sized messages, the ZeRO-1 reduce-scatter / all-gather;
- `paths_muon`: distributed Muon (with ZeRO-1 AdamW) against the single-process optimizer;
- `bandwidth`: bus bandwidth (nccl-tests' conventions) and the expected link rates; `report`: lines, table, JSON;
- `data`: the synthetic corpus, tokenizer and shards the training paths read.
"""
